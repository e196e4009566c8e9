"""One GPU holds everything (marker `gpu`; run by scripts/gpu_check.sh): a shared-model
team's FSDP2 learner in bf16-mixed precision and its vLLM engine (the hf engine where vLLM
is missing, as on the GPU machine this project gets) placed together on GPU 0 by drmas
train, weights going back over gloo through host memory. A few real steps with weight
updates under max_staleness=0, so every batch was sampled by the weights it trains: the
engine's sampling log-probs must match the learner's at step 1 (importance weights ~1,
none capped) and every weight load must match the published digest."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import drmas, read_metrics, read_summary

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(300),
]

STEPS = 4


# The command gpu_check.sh --dry-run plans on CPU (placement.gpus=1) and this test runs.
def colocated_overrides(engine: str) -> list[str]:
    return [
        "experiment=tiny_math_shared",
        "models.policy.precision=bf16-mixed",
        "models.policy.lr=1e-4",
        "models.policy.warmstart.steps=300",
        f"actor.engine.name={engine}",
        "actor.engine.dtype=bfloat16",
        "actor.engine.max_model_len=512",
        "actor.engine.gpu_memory_utilization=0.3",
        f"train.steps={STEPS}",
        "group_size=8",
        "batch_groups=8",
        "val.every=0",
        "algorithm.max_staleness=0",
    ]


def test_learner_and_engine_share_one_gpu(tmp_path: Path) -> None:
    engine = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    run_dir = tmp_path / "run"
    out = drmas(
        "train",
        *colocated_overrides(engine),
        "placement.gpus=1",
        f"run.dir={run_dir}",
        f"run.cache_dir={tmp_path / 'cache'}",
        timeout=270,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "shared GPUs: 0" in out.stdout and "weights: gloo" in out.stdout
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert summary["trained_groups"]["policy"] == STEPS * 8
    # the engine holds bf16 like the published copies: every load's digest is compared
    assert c["weight_digest_match"] == c["weight_loads"] > 0
    assert c.get("weight_digest_mismatch", 0) == 0
    steps = [x for x in read_metrics(run_dir) if "is_weight/policy" in x]
    assert len(steps) == STEPS
    first = steps[0]  # sampled by version 0 = the learner's weights before any update
    assert 0.9 < first["is_weight/policy"] < 1.1, first
    assert first["is_capped_frac/policy"] < 0.01, first
    assert all(x["grad_norm/policy"] > 0 for x in steps)
    print(
        f"\ncolocated on one GPU ({engine}, bf16-mixed): is_weight {first['is_weight/policy']:.4f}, "
        f"capped {first['is_capped_frac/policy']:.4f}, weight loads {c.get('weight_loads')}"
    )
