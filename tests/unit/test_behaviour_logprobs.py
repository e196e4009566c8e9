"""At step 1 the learner's π_old is the policy the actor sampled with, so the off-policy
correction must be a no-op: the hf engine's behaviour log-probs (KV cache, left-padded
continuous batching, one token at a time) equal the learner's own log-probs of the same
tokens (FSDP2 model, right-padded or packed micro-batches, one full forward).

In process: the builtin tiny model (not warm-started), the hf engine on the CPU in fp32,
a one-rank gloo group for the learner. algorithm.max_staleness=0 and every sample at
version 0: exactly the data the broker hands the learner for its first step.

Tolerance: both sides compute log_softmax(logits / T) in float32 from the same fp32
weights; they differ only in the order of float32 sums (cached attention vs one pass,
other padding), a few 1e-7 per logit. |Δ log p| < 1e-4 per token leaves a wide margin
and is still far inside PPO's trust region (a ratio of 1 ± 0.2 is |Δ log p| ≈ 0.2).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from drmas.actors.engines.hf import HFEngine
from drmas.config import load_config
from drmas.config.actor import EngineConfig
from drmas.config.model import WarmStartConfig
from drmas.models.builtin import resolve_model_path
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.engine import GenerateRequest, GenerateResult
from drmas.protocol.messages import BatchShard, Sample
from drmas.transports.ports import free_port

TEMPERATURE = 0.7
# The engine samples in a nucleus (as validation may) and still reports the log-prob before
# the cut, the learner's; training itself refuses sampling.top_p < 1 (config rules).
TOP_P = 0.9
PROMPTS = [
    "Solve.\nQuestion: 3+4\nSolver:",
    "Check.\nQuestion: 12-19\nSolver: \\boxed{-7}\nVerifier:",
    "Hi",
    "Solve.\nQuestion: 18+18\nSolver: \\boxed{35}\nVerifier: <verify>no</verify>\nSolver:",
    "Solve.\nQuestion: 9-2\nSolver:",
    "Check.\nQuestion: 1+1\nSolver: \\boxed{2}\nVerifier:",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


AGENTS = ("solver", "verifier")


def sample_with_the_actor_engine(
    model_path: Path, temperatures: dict[str, float] | None = None
) -> list[Sample]:
    """Every prompt generated concurrently (one continuous batch), as an actor does; prompt
    i by agent AGENTS[i % 2], at its temperature in `temperatures` (default TEMPERATURE)."""
    temps = temperatures or dict.fromkeys(AGENTS, TEMPERATURE)

    async def main() -> tuple[list[list[int]], list[GenerateResult]]:
        engine = HFEngine("policy", model_path, EngineConfig(device="cpu", dtype="float32"))
        await engine.start()
        try:
            prompts = [
                list(engine.tokenizer(p, add_special_tokens=False).input_ids) for p in PROMPTS
            ]
            requests = [
                GenerateRequest(p, temps[AGENTS[i % 2]], TOP_P, max_new_tokens=12)
                for i, p in enumerate(prompts)
            ]
            return prompts, list(await asyncio.gather(*(engine.generate(r) for r in requests)))
        finally:
            await engine.close()

    prompts, results = asyncio.run(main())
    return [
        Sample(
            agent=AGENTS[i % 2],
            prompt_ids=pack_ids(torch.tensor(prompt)),
            response_ids=pack_ids(torch.tensor(result.token_ids)),
            logprobs=pack_logprobs(torch.tensor(result.logprobs)),
            advantage=1.0 if i % 3 else -1.0,
            version=result.version,
        )
        for i, (prompt, result) in enumerate(zip(prompts, results))
    ]


@pytest.mark.parametrize(
    ("pack", "verifier_temperature"), [(False, None), (True, None), (False, 1.3)]
)
def test_learner_pi_old_equals_the_actors_behaviour_logprobs(
    model_path: Path, pack: bool, verifier_temperature: float | None
) -> None:
    """With agents.verifier.sampling.temperature set, the Verifier samples at its own
    temperature and the learner must score its samples at that one, the Solver's at the
    run's (one shared model, so both in one step)."""
    import torch.distributed as dist

    from drmas.learners.trainer import Trainer

    torch.set_num_threads(1)
    own = [] if verifier_temperature is None else [
        f"agents.verifier.sampling.temperature={verifier_temperature}"
    ]  # fmt: skip
    temperatures = {"solver": TEMPERATURE, "verifier": verifier_temperature or TEMPERATURE}
    samples = sample_with_the_actor_engine(model_path, temperatures)
    assert {s.version for s in samples} == {0}
    cfg = load_config(
        [
            "experiment=tiny_math_shared",
            f"models.policy.path={model_path}",
            "models.policy.precision=fp32",
            "algorithm.max_staleness=0",
            f"sampling.temperature={TEMPERATURE}",
            f"learner.pack={str(pack).lower()}",
            *own,
        ]
    )
    tokens = sum(len(s.response_ids) // 4 for s in samples)
    shard = BatchShard("policy", 0, 0, 1, samples, [1.0] * len(samples), len(samples), tokens)

    url = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=url, rank=0, world_size=1)
    try:
        trainer = Trainer(cfg, "policy", 0, 1, "cpu")
        (mini,) = trainer._minibatches(shard)  # one update per batch: π_old = π_θ now
        deltas, behaviour, counted = [], [], 0
        with torch.no_grad():
            for agent in trainer.agents:
                for mb in mini.plan[agent]:
                    assert (mb.packed is not None) == pack
                    old, _ = trainer.token_stats(trainer.model, mb, False)  # [B, L-1]
                    real = mb.mask.bool()
                    deltas.append((old - mb.behaviour_logprobs)[real])
                    behaviour.append(mb.behaviour_logprobs[real])
                    counted += int(real.sum())
        metrics = trainer.step(shard)
    finally:
        dist.destroy_process_group()

    assert counted == tokens >= 30  # every sampled token compared, and enough of them
    delta = torch.cat(deltas)
    # not a vacuous match: the tokens were sampled, far from certain (log p ≈ 0)
    assert float(torch.cat(behaviour).mean()) < -0.5
    assert float(delta.abs().max()) < 1e-4
    # what the loss sees: importance weights π_old/π_behaviour ≈ 1, none capped, and
    # ppo_kl 0 (π_old is the policy before the only update, in fp32 exactly)
    assert metrics["is_weight/policy"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["is_capped_frac/policy"] == 0.0
    assert metrics["ppo_kl/policy"] == 0.0
