"""A heterogeneous team end to end: agents on models of different sizes, each model its
own learner group with its own world size and optimizer settings, stepping on its own."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.integration.conftest import FAST, drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow


def test_verifier_on_a_larger_model_with_two_ranks(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    out = drmas(
        "train",
        *FAST,
        "experiment=tiny_math_hetero",
        "train.steps=3",
        "val.every=0",
        f"run.dir={run_dir}",
        f"run.cache_dir={model_cache}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # each model's learner group has its own world size
    logs = run_dir / "logs"
    assert "verifier rank 1/2 ready" in (logs / "learner-verifier-1.log").read_text()
    assert "solver rank 0/1 ready" in (logs / "learner-solver-0.log").read_text()
    assert not (logs / "learner-solver-1.log").exists()
    # and its own architecture: the final weights differ in size
    solver = load_file(str(run_dir / "models" / "solver" / "model.safetensors"))
    verifier = load_file(str(run_dir / "models" / "verifier" / "model.safetensors"))
    assert solver["model.embed_tokens.weight"].shape[1] == 128
    assert verifier["model.embed_tokens.weight"].shape[1] == 256
    assert sum(t.numel() for t in verifier.values()) > 4 * sum(t.numel() for t in solver.values())
    summary = read_summary(run_dir)
    assert summary["versions"] == {"solver": 3, "verifier": 3}
    assert summary["counters"].get("weight_digest_mismatch", 0) == 0
    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    for line in train:
        assert "grad_norm/solver" in line and "grad_norm/verifier" in line
