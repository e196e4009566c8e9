"""`drmas train` on a program written against the OpenAI client (tests/fixtures/
openai_program.py): real broker, learner and actor processes; the actor runs the program
with an in-process client; the broker trains both agents' steps on their shared model,
pays the critic its own reward, and validates; the program's metrics reach the log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, check_accounting, read_metrics, read_summary

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("endpoint", ["in_process", "http"])
def test_a_program_team_trains_its_agents_on_one_shared_model(
    tmp_path: Path, model_cache: Path, endpoint: str
) -> None:
    """Both transports: the client calls the actor in process, or over the actor's HTTP
    endpoint with the run's bearer token."""
    run_dir = tmp_path / "run"
    program = REPO / "tests" / "fixtures" / "openai_program.py"
    out = subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", "train", "experiment=tiny_math_shared",
         f"workflow.target={program}:episode", "~agents",
         "+agents={writer: {model: policy}, critic: {model: policy}}",
         "agents.critic.sampling.max_new_tokens=6", f"workflow.endpoint={endpoint}",
         "train.steps=2", "group_size=4", "batch_groups=2", "val.every=2", "val.num_tasks=8",
         "models.policy.warmstart.steps=60", f"run.dir={run_dir}", f"run.cache_dir={model_cache}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = read_metrics(run_dir)
    train = [x for x in lines if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2]
    for line in train:  # both agents' steps trained the one model
        assert "reward/writer/mean" in line and "reward/critic/mean" in line
        assert "loss/policy" in line
    assert any("rollout/parsed" in x for x in train)  # the program's own metric
    val = [x for x in lines if "val/tasks" in x]
    assert {x["step"] for x in val} == {0, 2} and all(x["val/tasks"] == 8 for x in val)
    check_accounting(read_summary(run_dir), batch_groups=2)
    assert (run_dir / "endpoint.secret").is_file() == (endpoint == "http")
