"""What each role's job asks Slurm for by default (configs/slurm/role/*.yaml, docs/deploy.md's
table), as the real controller records it (`scontrol show job`): learners on the
`learners` partition with one GPU per rank, actors on `actors` with one GPU each, 8 CPUs
per task, 64 / 32 GB, 24 hours. The jobs are submitted held (`--hold`), so they never run
and need no run folder; the test cancels them.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.conftest import REPO
from tests.integration.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

HOLD = "+hydra.launcher.additional_parameters.hold=true"


def test_each_role_asks_slurm_for_its_configured_resources(
    tmp_path: Path, slurm_cluster: SlurmCluster
) -> None:
    logs, config = tmp_path / "slurm-logs", tmp_path / "config.yaml"
    env = {**slurm_cluster.env, "DRMAS_SLURM_LOGS": str(logs)}
    submit = [sys.executable, "-m", "drmas.launch.slurm", "-m", f"run_config={config}", HOLD]
    with (tmp_path / "submit.log").open("w") as out:
        submitters = [
            subprocess.Popen([*submit, *args], cwd=REPO, env=env, stdout=out, stderr=out)
            for args in (
                ["role=learner", "model=solver", "hydra.launcher.tasks_per_node=2"],
                ["role=actor", "index=range(2)"],
            )
        ]
    try:
        deadline = time.monotonic() + 120
        jobs: list[dict[str, str]] = []
        while len(jobs) < 2 and time.monotonic() < deadline:
            assert all(p.poll() is None for p in submitters), (tmp_path / "submit.log").read_text()
            jobs = slurm_cluster.jobs_logging_to(logs)
            time.sleep(1)
        learner = next(j for j in jobs if j["JobName"] == "drmas-learner")
        actors = next(j for j in jobs if j["JobName"] == "drmas-actor")
    finally:
        for job in slurm_cluster.jobs_logging_to(logs):
            slurm_cluster.run("scancel", job["JobId"])
        for proc in submitters:  # each waits for results a cancelled job never writes
            proc.kill()
            proc.wait(30)
    held = ("PENDING", "JobHeldUser")
    assert (learner["JobState"], learner["Reason"]) == held
    assert (actors["JobState"], actors["Reason"]) == held
    assert {k: learner[k] for k in FIELDS} == {
        "Partition": "learners",
        "NumTasks": "2",
        "CPUs/Task": "8",
        "TresPerNode": "gres:gpu:2",  # one GPU per learner rank
        "MinMemoryNode": "64G",
        "TimeLimit": "1-00:00:00",
    }
    assert {k: actors[k] for k in FIELDS} == {
        "Partition": "actors",
        "NumTasks": "1",
        "CPUs/Task": "8",
        "TresPerNode": "gres:gpu:1",  # tensor_parallel_size 1
        "MinMemoryNode": "32G",
        "TimeLimit": "1-00:00:00",
    }
    assert actors["ArrayTaskId"] == "0-1%2"  # one array: index=range(2), both at once


FIELDS = ("Partition", "NumTasks", "CPUs/Task", "TresPerNode", "MinMemoryNode", "TimeLimit")
