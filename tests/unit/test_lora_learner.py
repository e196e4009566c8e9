"""The learner on a LoRA base (issue #23): a frozen base, one adapter per agent, each
adapter trained by its own agents' steps only.

In process: the builtin tiny model (not warm-started) as the base, four agents a, b, c, d
on it (four adapters), a one-rank gloo group (tests/integration/test_lora_learner.py runs
two ranks). Expected values come from the contract itself: an adapter none of whose
agents has a step in the batch is bit-identical after the update; an adapter's update in
a batch of every agent is bit-identical to its update in a batch of its agent's steps
alone (same micro-batches, same loss normaliser, its own clip), since the other agents'
micro-batches run other adapters and give it no gradient.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch.distributed.tensor import DTensor

from drmas.config import AgentConfig, DrmasConfig
from drmas.config.learner import LearnerConfig
from drmas.config.model import LoraConfig, ModelConfig, WarmStartConfig
from drmas.models.builtin import resolve_model_path
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import BatchShard, Sample

if TYPE_CHECKING:
    from drmas.learners.trainer import Trainer

MODEL = "policy"
AGENTS = ("a", "b", "c", "d")
RANK = 4
LAYERS = 4  # builtin:tiny-qwen2
TARGETS = ("k_proj", "o_proj", "q_proj", "v_proj")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def lora_config(model_path: Path, precision: str = "fp32") -> DrmasConfig:
    cfg = DrmasConfig(
        models={
            MODEL: ModelConfig(
                path=str(model_path),
                lr=1e-3,
                precision=precision,  # type: ignore[arg-type]
                lora=LoraConfig(rank=RANK, init_seed=5),
            )
        },
        agents={agent: AgentConfig(model=MODEL) for agent in AGENTS},
        learner=LearnerConfig(micro_batch_size=2, grad_clip=0.05),
    )
    cfg.sampling.temperature = 0.7
    return cfg


def make_samples(agents: tuple[str, ...] = AGENTS, per_agent: int = 3) -> list[Sample]:
    gen = torch.Generator().manual_seed(11)
    samples = []
    for i in range(per_agent * len(agents)):
        agent = agents[i % len(agents)]
        p, t = 3 + i % 4, 2 + (i * 5) % 7
        ids = torch.randint(1, 40, (p + t,), generator=gen)
        behaviour = -(0.5 + 3 * torch.rand(t, generator=gen))
        samples.append(
            Sample(
                agent=agent,
                prompt_ids=pack_ids(ids[:p]),
                response_ids=pack_ids(ids[p:]),
                logprobs=pack_logprobs(behaviour),
                advantage=float(torch.randn((), generator=gen)),
                version=0,
            )
        )
    return samples


def shard_of(samples: list[Sample], totals_of: list[Sample] | None = None) -> BatchShard:
    """One rank's shard; its loss normaliser counts `totals_of` (default: the samples)."""
    counted = samples if totals_of is None else totals_of
    tokens = sum(len(s.response_ids) // 4 for s in counted)
    return BatchShard(MODEL, 0, 0, 1, samples, [1.0] * len(samples), len(counted), tokens)


def adapters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return dict(trainer.full_state_dict_iter())


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def expected_names() -> list[str]:
    """The wire names the contract gives, built by hand."""
    return sorted(
        f"base_model.model.model.layers.{layer}.self_attn.{target}.lora_{ab}.{agent}.weight"
        for layer in range(LAYERS)
        for target in TARGETS
        for ab in "AB"
        for agent in AGENTS
    )


def test_only_the_batchs_agents_adapters_move(model_path: Path, group: None) -> None:
    from drmas.learners.trainer import Trainer

    trainer = Trainer(lora_config(model_path), MODEL, 0, 1, "cpu")
    base_before = {
        n: local(p.detach()).clone()
        for n, p in trainer.model.named_parameters()
        if "lora_" not in n
    }
    before = adapters(trainer)
    assert list(before) == expected_names()
    only_b = [s for s in make_samples() if s.agent == "b"]
    trainer.step(shard_of(only_b))
    after = adapters(trainer)
    for name, tensor in after.items():
        if ".b." in name and ".lora_B." in name:
            assert not torch.equal(tensor, before[name]), name  # B starts at 0: its grad moves it
        elif ".b." not in name:
            assert torch.equal(tensor, before[name]), name  # a, c, d: bit-identical
    for name, param in trainer.model.named_parameters():
        if "lora_" in name:
            assert param.requires_grad, name  # activation left every adapter trainable
            state = trainer.optimizer.state[param]
            assert float(state["step"]) == (1.0 if ".b." in name else 0.0), name
        else:
            assert not param.requires_grad, name
            assert torch.equal(local(param.detach()), base_before[name]), name  # frozen base


def test_each_adapter_moves_by_its_own_agents_steps_only(model_path: Path, group: None) -> None:
    from drmas.learners.trainer import Trainer

    cfg = lora_config(model_path)
    samples = make_samples()
    mixed = Trainer(cfg, MODEL, 0, 1, "cpu")
    start = adapters(mixed)
    metrics = mixed.step(shard_of(samples))
    assert metrics[f"grad_norm/{MODEL}"] > cfg.learner.grad_clip  # clipping was exercised
    together = adapters(mixed)
    for agent in AGENTS:
        alone = Trainer(cfg, MODEL, 0, 1, "cpu")
        assert all(torch.equal(t, start[n]) for n, t in adapters(alone).items())
        own = [s for s in samples if s.agent == agent]
        alone.step(shard_of(own, totals_of=samples))  # same loss normaliser as the batch
        for name, tensor in adapters(alone).items():
            if f".{agent}." in name:
                assert torch.equal(together[name], tensor), name
                if ".lora_B." in name:
                    assert not torch.equal(tensor, start[name]), name


def test_learning_rate_per_adapter(model_path: Path, group: None) -> None:
    from drmas.learners.trainer import Trainer

    cfg = lora_config(model_path)
    cfg.agents["c"].lr = 5e-4
    trainer = Trainer(cfg, MODEL, 0, 1, "cpu")
    groups = trainer.optimizer.param_groups
    assert [g["lr"] for g in groups] == [1e-3, 1e-3, 5e-4, 1e-3]  # adapters a, b, c, d
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    for agent, g in zip(AGENTS, groups):
        assert len(g["params"]) == LAYERS * len(TARGETS) * 2
        assert all(f".{agent}." in names[id(p)] for p in g["params"])


def test_publish_is_the_adapters_and_starts_where_an_engine_starts(
    model_path: Path, group: None
) -> None:
    """The engine side builds its adapters with the same add_adapters call on the same
    base: the learner's first publish must fingerprint like the engine's own adapters."""
    from transformers import AutoModelForCausalLM

    from drmas.learners.trainer import Trainer
    from drmas.models.lora import adapter_param_names, add_adapters
    from drmas.transports.digest import digest_of

    cfg = lora_config(model_path, "bf16-mixed")
    trainer = Trainer(cfg, MODEL, 0, 1, "cpu")
    specs = trainer.param_specs()
    stream = list(trainer.full_state_dict_iter(dtype=trainer.publish_dtype))
    assert [s.name for s in specs] == [n for n, _ in stream] == expected_names()
    assert {s.dtype for s in specs} == {"bfloat16"}
    assert all(t.dtype == torch.bfloat16 for _, t in stream)
    for spec, (_, tensor) in zip(specs, stream):
        assert tuple(tensor.shape) == spec.shape
        assert spec.shape[0 if ".lora_A." in spec.name else 1] == RANK

    engine_side = add_adapters(
        AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16),
        cfg.models[MODEL].lora,
        list(AGENTS),
    )
    params = dict(engine_side.named_parameters())
    engine = [(n, params[n].detach().to(torch.bfloat16)) for n in adapter_param_names(engine_side)]
    assert digest_of(stream) == digest_of(engine)


def test_bf16_mixed_computes_in_bf16_and_keeps_fp32_adapters(model_path: Path, group: None) -> None:
    from drmas.learners.trainer import Trainer

    trainer = Trainer(lora_config(model_path, "bf16-mixed"), MODEL, 0, 1, "cpu")
    seen: dict[str, set[torch.dtype]] = {}

    def record(module: torch.nn.Module, _: object, output: torch.Tensor) -> None:
        name = modules[module]
        seen.setdefault(name, set()).update({output.dtype, module.weight.dtype})

    modules = {}
    for name, module in trainer.model.named_modules():
        if name.endswith(("q_proj.base_layer", "q_proj.lora_A.b", "q_proj.lora_B.b")):
            modules[module] = name
            module.register_forward_hook(record)
    trainer.step(shard_of([s for s in make_samples() if s.agent == "b"]))
    assert len(seen) == 3 * LAYERS
    assert all(dtypes == {torch.bfloat16} for dtypes in seen.values()), seen
    for name, param in trainer.model.named_parameters():
        assert param.dtype == torch.float32, name  # the masters (the base stays as loaded)
    for value in trainer.optimizer.state.values():
        assert value["exp_avg"].dtype == torch.float32


def test_checkpoint_keeps_adapters_and_their_optimizer_state(
    model_path: Path, group: None, tmp_path: Path
) -> None:
    from drmas.checkpoints import store
    from drmas.checkpoints.tensors import layout_name
    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer

    cfg = lora_config(model_path)
    samples = make_samples()
    first = Trainer(cfg, MODEL, 0, 1, "cpu")
    first.step(shard_of([s for s in samples if s.agent in ("a", "b")]))  # c, d untrained
    folder = ckpt.save(first, tmp_path / MODEL, 1, keep=2)
    keys = json.loads((folder / layout_name(0)).read_text())["layout"]
    frozen = [k for k in keys if k.startswith("model/") and "lora_" not in k]
    # The frozen base is not saved, except the tied alias of its embedding (lm_head):
    # torch's ignore_frozen_params drops the parameters named_parameters() lists, which
    # names a tied parameter once.
    assert frozen == ["model/base_model.model.lm_head.weight"]

    resumed = Trainer(cfg, MODEL, 0, 1, "cpu")
    found = store.find(tmp_path / MODEL, 1)
    assert found is not None
    assert ckpt.load(resumed, found) == store.read_manifest(folder)["optim_digests"][0]  # type: ignore[index]
    assert adapters(resumed).keys() == adapters(first).keys()
    for name, tensor in adapters(first).items():
        assert torch.equal(adapters(resumed)[name], tensor), name
    pairs = list(zip(first.model.parameters(), resumed.model.parameters()))
    for p_first, p_resumed in pairs:
        if not p_first.requires_grad:
            continue
        s1, s2 = first.optimizer.state[p_first], resumed.optimizer.state[p_resumed]
        assert s1.keys() == s2.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in s1:
            assert torch.equal(local(s1[key]), local(s2[key])), key
    # and they go on alike: every adapter's next update, c's first, is the same
    for trainer in (first, resumed):
        trainer.step(shard_of(samples))
    for name, tensor in adapters(first).items():
        assert torch.equal(adapters(resumed)[name], tensor), name


def test_export_is_the_base_and_a_peft_folder_per_adapter(
    model_path: Path, group: None, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from drmas.learners.trainer import Trainer

    trainer = Trainer(lora_config(model_path), MODEL, 0, 1, "cpu")
    trainer.step(shard_of(make_samples()))
    trained = adapters(trainer)
    out = tmp_path / "models" / MODEL
    trainer.save_pretrained(out)

    source = dict(AutoModelForCausalLM.from_pretrained(model_path).named_parameters())
    base = AutoModelForCausalLM.from_pretrained(out)
    saved = dict(base.named_parameters())
    assert saved.keys() == source.keys()
    for name, tensor in source.items():
        assert torch.equal(saved[name], tensor), name  # the base, unchanged
    assert (out / "tokenizer.json").exists()
    assert sorted(p.name for p in (out / "adapters").iterdir()) == list(AGENTS)

    ids = torch.tensor([[3, 9, 14, 2, 7, 21]])
    loaded = PeftModel.from_pretrained(base, str(out / "adapters" / "c"), adapter_name="c")
    loaded_params = dict(loaded.named_parameters())
    for name, tensor in trained.items():
        if ".c." in name:
            assert torch.equal(loaded_params[name], tensor), name
    trainer.use_agent("c")
    trainer.model.eval()
    with torch.no_grad():
        ours = trainer.model(input_ids=ids).logits
        theirs = loaded.eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def _variant(cfg: DrmasConfig, variant: str) -> DrmasConfig:
    if variant == "pack":
        cfg.learner.pack = True
    elif variant == "checkpointing":
        cfg.models[MODEL].activation_checkpointing = True
    elif variant == "ppo":  # π_old fixed first, per agent with its adapter
        cfg.learner.ppo_minibatches, cfg.learner.ppo_epochs = 2, 2
    elif variant == "kl":  # the reference is the frozen base
        cfg.algorithm.loss.kl_coef = 0.1
    return cfg


@pytest.mark.parametrize("variant", ["plain", "pack", "checkpointing", "ppo", "kl"])
def test_learner_options_keep_adapters_apart(model_path: Path, group: None, variant: str) -> None:
    """Packing and activation checkpointing change how the batch is computed, not the
    update; several PPO updates and the KL term still move only the batch's adapters."""
    from drmas.learners.trainer import Trainer

    batch = shard_of([s for s in make_samples() if s.agent in ("a", "c")])
    plain = Trainer(lora_config(model_path), MODEL, 0, 1, "cpu")
    plain.step(batch)
    trainer = Trainer(_variant(lora_config(model_path), variant), MODEL, 0, 1, "cpu")
    before = adapters(trainer)
    metrics = trainer.step(batch)
    after = adapters(trainer)
    assert metrics[f"skipped_steps/{MODEL}"] == 0.0
    for name, start in before.items():
        if ".b." in name or ".d." in name:
            assert torch.equal(after[name], start), name
        elif ".lora_B." in name:
            assert not torch.equal(after[name], start), name
    if variant in ("plain", "pack", "checkpointing"):
        # the same float32 math in another order; AdamW's first step is ≈ lr·sign(g)
        for name, expected in adapters(plain).items():
            torch.testing.assert_close(after[name], expected, atol=1e-6, rtol=1e-5, msg=name)
    if variant == "kl":
        assert metrics[f"kl/{MODEL}"] == pytest.approx(0.0, abs=1e-9)  # policy = base at start
    if variant == "ppo":
        assert metrics[f"updates/{MODEL}"] == 4.0 and metrics[f"ppo_kl/{MODEL}"] != 0.0


def test_kl_reference_is_the_base_with_adapters_off(model_path: Path, group: None) -> None:
    """With kl_coef > 0 on a LoRA base the reference is the sharded base itself with every
    adapter switched off, not a second copy: after a step has moved the adapters, it
    computes exactly the untouched base model, and the agent's adapter is on again after."""
    from transformers import AutoModelForCausalLM

    from drmas.learners.trainer import Trainer
    from drmas.models.lora import is_adapter_param

    trainer = Trainer(_variant(lora_config(model_path), "kl"), MODEL, 0, 1, "cpu")
    assert trainer.reference is None  # no second copy of the base
    trainer.step(shard_of(make_samples()))
    second = trainer.step(shard_of(make_samples()))
    assert second[f"kl/{MODEL}"] > 0.0  # the policy has left the base
    base = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids = torch.tensor([[3, 9, 14, 2, 7, 21]])
    trainer.use_agent("a")
    trainer.model.eval()
    with torch.no_grad():
        with trainer.lora.off():
            off = trainer.model(input_ids=ids).logits
        on = trainer.model(input_ids=ids).logits
        expected = base(input_ids=ids).logits
    torch.testing.assert_close(off, expected, rtol=1e-5, atol=1e-5)
    assert (on - expected).abs().max() > 1e-4  # adapter a is back on
    adapter_params = [p for n, p in trainer.model.named_parameters() if is_adapter_param(n)]
    assert adapter_params and all(p.requires_grad for p in adapter_params)
