"""What the learner no longer spends time on (issue #46), and that nothing else changed:
the fused AdamW of a whole model, the per-agent gradient norm when one agent acts, and
the finiteness check of the weights.

In process, on the builtin tiny model (a one-rank gloo group). References are computed
independently: torch's per-tensor AdamW on a copy of the same parameters and gradients,
and torch.isfinite.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from drmas.config import AgentConfig, DrmasConfig
from drmas.config.learner import LearnerConfig
from drmas.config.model import ModelConfig, WarmStartConfig
from drmas.models.builtin import resolve_model_path
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import BatchShard, Sample


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def config(model_path: Path, agents: tuple[str, ...]) -> DrmasConfig:
    return DrmasConfig(
        models={"m": ModelConfig(path=str(model_path), lr=1e-3)},
        agents={a: AgentConfig(model="m") for a in agents},
        learner=LearnerConfig(micro_batch_size=2, grad_clip=1e6),
    )


def shard(agents: tuple[str, ...]) -> BatchShard:
    gen = torch.Generator().manual_seed(5)
    samples = []
    for i in range(6):
        ids = torch.randint(3, 90, (9,), generator=gen)
        samples.append(
            Sample(
                agents[i % len(agents)],
                pack_ids(ids[:5]),
                pack_ids(ids[5:]),
                pack_logprobs(-torch.rand(4, generator=gen)),
                float(torch.randn((), generator=gen)),
                0,
            )
        )
    return BatchShard("m", 0, 0, 1, samples, [1.0] * 6, 6, 24)


def test_a_whole_model_steps_with_fused_adamw_as_plain_adamw_would(
    model_path: Path, group: None
) -> None:
    from drmas.learners.trainer import Trainer

    trainer = Trainer(config(model_path, ("a",)), "m", 0, 1, "cpu")
    assert trainer.optimizer.defaults["fused"] is True
    params = list(trainer.model.parameters())
    gen = torch.Generator().manual_seed(1)
    copies = [p.full_tensor().detach().clone().requires_grad_() for p in params]
    plain = torch.optim.AdamW(copies, lr=1e-3, weight_decay=0.01, foreach=False)
    for _ in range(2):
        for p, c in zip(params, copies):
            g = torch.randn(c.shape, generator=gen)
            c.grad = g.clone()
            p.grad = torch.distributed.tensor.distribute_tensor(g, p.device_mesh, p.placements)
        trainer.optimizer.step()
        plain.step()
    for p, c in zip(params, copies):
        torch.testing.assert_close(p.full_tensor(), c.detach(), rtol=1e-6, atol=1e-7)


def test_the_agent_that_acts_alone_has_the_updates_gradient_norm(
    model_path: Path, group: None
) -> None:
    from drmas.learners.trainer import Trainer

    agents = ("a", "b")
    alone = Trainer(config(model_path, agents), "m", 0, 1, "cpu").step(shard(("a",)))
    assert alone["agent_grad_norm/a"] == pytest.approx(alone["grad_norm/m"], rel=1e-9)
    assert "agent_grad_norm/b" not in alone  # b made no step

    both = Trainer(config(model_path, agents), "m", 0, 1, "cpu").step(shard(agents))
    a, b, total = both["agent_grad_norm/a"], both["agent_grad_norm/b"], both["grad_norm/m"]
    assert 0 < a < total + b and 0 < b < total + a  # each its own part (triangle inequality)
    assert a != pytest.approx(total) and b != pytest.approx(total)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_finite_finds_every_nan_and_inf(dtype: torch.dtype, bad: float) -> None:
    from drmas.finite import finite

    values = torch.randn(4097).to(dtype)
    assert finite(values) and bool(torch.isfinite(values).all())
    for where in (0, 1234, 4096):
        poisoned = values.clone()
        poisoned[where] = bad
        assert not finite(poisoned.view(17, 241)), (where, bad)
    assert finite(torch.empty(0, dtype=dtype))
