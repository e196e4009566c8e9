"""`drmas probe` on the GPU (marker `gpu`; run by scripts/gpu_check.sh): the default math
team's builtin models, its hf engines sampling on CUDA and the one-rank learner (an NCCL
group) measuring each agent's gradient second moment on CUDA, in the synthetic mode whose
outcome tests/integration/test_probe.py derives: Solver scores N(0, 3) and Verifier
N(1, 0.3) pooled over all steps inflate the Solver's gradient (F ≈ 1.7) and deflate the
Verifier's (F ≈ 0.16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import drmas

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(240),
]


def test_probe_measures_on_the_gpu(tmp_path: Path) -> None:
    run = tmp_path / "probe"
    out = drmas(
        "probe",
        "group_size=4",
        "models.solver.warmstart.steps=60",
        "models.verifier.warmstart.steps=60",
        "probe.group_size=4",
        "probe.groups=24",
        "probe.rewards={solver: [0, 3], verifier: [1, 0.3]}",
        "learner.device=cuda",
        "actor.engine.device=cuda",
        f"run.dir={run}",
        f"run.cache_dir={tmp_path / 'cache'}",
        timeout=210,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((run / "probe.json").read_text())
    assert result["mode"] == "synthetic" and result["groups"] == 24
    solver = result["agents"]["solver"]["step_global"]
    verifier = result["agents"]["verifier"]["step_global"]
    assert solver["predicted_factor"] > 1.3 and solver["measured_ratio"] > 1.1
    assert verifier["predicted_factor"] < 0.4 and verifier["measured_ratio"] < 0.6
    print(
        f"\ndrmas probe on GPU: solver F {solver['predicted_factor']:.2f} measured "
        f"{solver['measured_ratio']:.2f}; verifier F {verifier['predicted_factor']:.2f} "
        f"measured {verifier['measured_ratio']:.2f}"
    )
