"""A learner job cancelled under a real Slurm, then the run resubmitted with run.resume
(docs/deploy.md, "Elastic actors and cancelled jobs"). Once the solver is past version 4
(checkpoints every 2 steps), its learner job is `scancel`-ed: its submitting command
stops with an error naming the job and its state, although this cluster has no
accounting (`sacct` fails; drmas/launch/slurm_jobs.py asks the controller). The rest of the
run stops by itself: the solver's ranks tell the broker their job id as they leave, the
broker waits broker.learner_rejoin_s for them, then tells every other job to stop, names
the cancelled job in its log and broker_summary.json and exits 1; the verifier's learner
job and the actor's job end COMPLETED. Every role is submitted again with
`run.resume=RUN_DIR`: the solver resumes from a checkpoint and the run trains to its last
step, every job of the second run COMPLETED.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import read_metrics
from tests.integration.slurm_cluster import SMALL_JOB, SlurmCluster, job_logs, submit, wait_all
from tests.integration.slurm_run import prepare_run, start_broker, status

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# the sim engine's decode sleeps pace the run (about 1.5 s a step) so that the cancel
# lands mid-run without loading the CPU
STEPS = 16
SHORT = [
    f"train.steps={STEPS}",
    "actor.engine.name=sim",
    "actor.engine.sim_token_latency_s=0.02",
    "checkpoint.every=2",
    "group_size=4",
    "batch_groups=2",
    "val.every=0",
    "models.solver.warmstart.steps=60",
    "models.verifier.warmstart.steps=60",
    "broker.heartbeat_timeout_s=20",
    "weights.timeout_s=30",
    "broker.learner_rejoin_s=10",
]
MODELS = ("solver", "verifier")


def submit_run(
    cluster: SlurmCluster, run_dir: Path, logs: Path, out: Path, *extra: str
) -> dict[str, subprocess.Popen[bytes]]:
    """Each model's learner group and one actor, as docs/deploy.md submits them."""
    config = f"run_config={run_dir / 'config.yaml'}"
    procs = {
        m: submit(cluster, logs, "role=learner", f"model={m}", config, *SMALL_JOB, *extra,
                  out=out / f"submit-{m}.log")
        for m in MODELS
    }  # fmt: skip
    procs["actor"] = submit(cluster, logs, "role=actor", "index=0", config, *SMALL_JOB, *extra,
                            out=out / "submit-actor.log")  # fmt: skip
    return procs


def stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def test_a_cancelled_learner_job_is_named_and_the_run_resumes(
    tmp_path: Path, model_cache: Path, slurm_cluster: SlurmCluster
) -> None:
    run_dir, address = prepare_run(tmp_path, model_cache, SHORT, "actors,learners,observer")
    logs, logs2 = tmp_path / "slurm-logs", tmp_path / "slurm-logs-2"
    broker = start_broker(run_dir, tmp_path / "broker.log", address)
    first = submit_run(slurm_cluster, run_dir, logs, tmp_path)
    second: dict[str, subprocess.Popen[bytes]] = {}
    resumed = None
    try:
        deadline = time.monotonic() + 300
        while status(run_dir)["models"]["solver"]["version"] < 4:
            assert time.monotonic() < deadline, "the solver never reached version 4"
            assert broker.poll() is None, "the broker ended early"
            time.sleep(2)
        (solver_job,) = [
            j["JobId"]
            for j in slurm_cluster.jobs_logging_to(logs)
            if "learnersolver" in j["StdOut"]
        ]
        assert slurm_cluster.run("scancel", solver_job).returncode == 0
        first["solver"].wait(180)  # the controller says CANCELLED: it stops, naming the job
        said = (tmp_path / "submit-solver.log").read_text()
        assert first["solver"].returncode != 0
        assert f"Job {solver_job}" in said and "CANCELLED" in said, said[-3000:]
        # the rest of the run ends by itself, the broker naming the cancelled job
        assert broker.wait(240) == 1, "the broker did not stop the run that lost a learner"
        wait_all([first["verifier"], first["actor"]], 240)
        assert [first["verifier"].returncode, first["actor"].returncode] == [0, 0]
        ended = {j["JobId"]: j["JobState"] for j in slurm_cluster.wait_ended(logs, 3, 120)}
        stop(list(first.values()))
        assert ended.pop(solver_job) == "CANCELLED" and set(ended.values()) == {"COMPLETED"}
        lost = json.loads((run_dir / "broker_summary.json").read_text())["learner_lost"]
        # the solver's one rank (a world size of 1 here) said why it left, naming its job
        assert "solver rank 0 ('learner-solver-0' on " in lost, lost
        assert re.search(r"left at version \d+: SIGTERM to pid \d+ on ", lost), lost
        assert f"Slurm job {solver_job} task 0" in lost, lost
        said = (tmp_path / "broker.log").read_text()
        assert f"Slurm job {solver_job} task 0" in said and "run.resume=RUN_DIR" in said

        resume = f"run.resume={run_dir}"
        resumed = start_broker(run_dir, tmp_path / "broker-2.log", address, resume)
        (tmp_path / "second").mkdir()
        second = submit_run(slurm_cluster, run_dir, logs2, tmp_path / "second",
                            f"overrides=[\"{resume}\"]")  # fmt: skip
        wait_all(list(second.values()), 420)
        assert resumed.wait(120) == 0
        jobs = slurm_cluster.wait_ended(logs2, 3, timeout=60)
    finally:
        stop([*first.values(), *second.values(), broker, *([resumed] if resumed else [])])
        for log in sorted(tmp_path.rglob("*.log")):
            if log.parent in (tmp_path, tmp_path / "second"):
                print(
                    f"--- {log.relative_to(tmp_path)}:\n{log.read_text(errors='replace')[-3000:]}"
                )
        print(job_logs(logs, tail=2500))
        print(job_logs(logs2, tail=2500))
    assert [p.returncode for p in second.values()] == [0, 0, 0]
    assert sorted(j["JobState"] for j in jobs) == ["COMPLETED"] * 3
    steps = [x["step"] for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert steps[-1] == STEPS and steps == sorted(set(steps)), steps  # went on, none twice
    text = job_logs(logs2)
    assert "Traceback" not in text
