"""docs/deploy.md's Slurm section run as written against a real one-node Slurm (the
`slurm_cluster` fixture): `drmas keys`, `drmas prepare deploy=slurm`, `drmas broker` on the
head node, then through hydra's submitit launcher one job per model's learner group
(2 Slurm tasks: world size 2, gloo) and an array of actors, each submitting command in the
background. The default team trains 3 steps and every job ends COMPLETED; learners and
actors ran in their own partitions and asked for the GPUs `drmas train`'s placement would
give them (one per learner rank, one per actor), as `scontrol show job` reports.

The only additions to the documented commands fit the jobs to the test node's 16 CPUs
(cpus_per_task=1, mem_gb=1) and shorten the run (train.steps=3, ...).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import read_metrics, read_summary
from tests.integration.slurm_cluster import SMALL_JOB, SlurmCluster, job_logs, submit, wait_all
from tests.integration.slurm_run import prepare_run, start_broker

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

STEPS = 3
SHORT = [
    f"train.steps={STEPS}",
    "group_size=4",
    "batch_groups=2",
    "val.every=0",
    "learner.world_size=2",
    "models.solver.warmstart.steps=60",  # the short build the other runs share
    "models.verifier.warmstart.steps=60",
    # margin for a loaded 2-core machine
    "broker.heartbeat_timeout_s=20",
    "weights.timeout_s=30",
]
ACTORS = 2
WAIT_S = 600


def test_documented_slurm_flow_trains_and_every_job_completes(
    tmp_path: Path, model_cache: Path, slurm_cluster: SlurmCluster
) -> None:
    run_dir, address = prepare_run(tmp_path, model_cache, SHORT, "actors,learners")
    logs = tmp_path / "slurm-logs"
    config = f"run_config={run_dir / 'config.yaml'}"
    broker_log = tmp_path / "broker.log"
    broker = start_broker(run_dir, broker_log, address)
    submitters = [
        submit(slurm_cluster, logs, "role=learner", f"model={model}", config,
               "hydra.launcher.tasks_per_node=2", *SMALL_JOB, out=tmp_path / f"submit-{model}.log")
        for model in ("solver", "verifier")
    ] + [
        submit(slurm_cluster, logs, "role=actor", f"index=range({ACTORS})", config, *SMALL_JOB,
               out=tmp_path / "submit-actors.log")
    ]  # fmt: skip
    try:
        wait_all(submitters, WAIT_S)
        broker.wait(120)  # a finished broker exits once every learner said Goodbye
        jobs = slurm_cluster.wait_ended(logs, 2 + ACTORS, timeout=60)
    finally:
        for proc in [*submitters, broker]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}")
        print(job_logs(logs, tail=2500))
        print(slurm_cluster.logs())
    assert [p.returncode for p in submitters] == [0, 0, 0]
    assert broker.returncode == 0

    assert sorted(j["JobState"] for j in jobs) == ["COMPLETED"] * (2 + ACTORS)
    learner_jobs = [j for j in jobs if j["JobName"] == "drmas-learner"]
    actor_jobs = [j for j in jobs if j["JobName"] == "drmas-actor"]
    assert len(learner_jobs) == 2 and len(actor_jobs) == ACTORS
    for job in learner_jobs:  # one GPU per rank, as placement plans a learner group
        assert (job["Partition"], job["NumTasks"], job["TresPerNode"]) == (
            "learners", "2", "gres:gpu:2",
        )  # fmt: skip
    for job in actor_jobs:  # one array, one element per actor, one GPU each
        assert (job["Partition"], job["NumTasks"], job["TresPerNode"]) == (
            "actors", "1", "gres:gpu:1",
        )  # fmt: skip
    assert sorted(j["ArrayTaskId"] for j in actor_jobs) == [str(i) for i in range(ACTORS)]

    text = job_logs(logs)  # each Slurm task's rank came from srun: both ranks of each group
    for model in ("solver", "verifier"):
        for rank in (0, 1):
            assert f"{model} rank {rank}/2 ready at version 0" in text
    assert "Traceback" not in text and "terminate called" not in text

    train = read_metrics(run_dir)
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    summary = read_summary(run_dir)
    assert summary["trained_groups"] == {"solver": STEPS * 2, "verifier": STEPS * 2}
    assert summary["leases"]["balanced"]
