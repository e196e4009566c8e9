"""Elastic actors and an actor's preemption under a real Slurm (docs/deploy.md, "Elastic
actors and cancelled jobs"): the run of test_slurm_flow with one learner rank per model
and one actor; once both models are past version 1, one more actor is submitted
(`role=actor index=1`). It attaches, gets the current weights and returns accepted
groups. Then the first actor's job gets `scancel --signal=TERM`, what a preemption sends
first (a plain scancel sends the same SIGTERM, then SIGKILL after KillWait): it says
Goodbye with its unfinished leases and ends cleanly (its job COMPLETED, its submitting
command exits 0), and the late actor carries the run on. The run is held open until
then, and stopped as an operator would stop a broker (SIGTERM): every job is told
Shutdown and ends COMPLETED, and broker_summary.json shows nothing lost or trained twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import HELD_OPEN, check_accounting, read_summary
from tests.integration.slurm_cluster import SMALL_JOB, SlurmCluster, job_logs, submit, wait_all
from tests.integration.slurm_run import prepare_run, start_broker, status

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

# The late actor takes 20-30 s to start on a loaded machine and the run must still be going
# when it returns groups: the run is held open (HELD_OPEN) until the test stops it. The sim
# engine's decode sleeps (0.02 s a token, about 1 s a turn) keep the CPU free meanwhile.
SHORT = [
    HELD_OPEN,
    "actor.engine.name=sim",
    "actor.engine.sim_token_latency_s=0.02",
    "group_size=4",
    "batch_groups=2",
    "val.every=0",
    "actor.max_groups=2",
    "models.solver.warmstart.steps=60",
    "models.verifier.warmstart.steps=60",
    "broker.heartbeat_timeout_s=20",
    "weights.timeout_s=30",
]
MODELS = ("solver", "verifier")


def actor(run_dir: Path, actor_id: str) -> dict[str, Any]:
    return {a["client_id"]: a for a in status(run_dir)["actors"]}.get(actor_id, {})


def wait_until(pred: Any, timeout: float, what: str, broker: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert broker.poll() is None, f"the broker ended (code {broker.returncode}) before: {what}"
        if value := pred():
            return value
        time.sleep(2)
    raise TimeoutError(what)


def test_an_actor_added_mid_run_trains_and_a_preempted_one_hands_back(
    tmp_path: Path, model_cache: Path, slurm_cluster: SlurmCluster
) -> None:
    run_dir, address = prepare_run(tmp_path, model_cache, SHORT, "actors,learners,observer")
    logs = tmp_path / "slurm-logs"
    config = f"run_config={run_dir / 'config.yaml'}"
    broker = start_broker(run_dir, tmp_path / "broker.log", address)
    submitters = {
        model: submit(slurm_cluster, logs, "role=learner", f"model={model}", config, *SMALL_JOB,
                      out=tmp_path / f"submit-{model}.log")
        for model in MODELS
    }  # fmt: skip
    submitters["first"] = submit(slurm_cluster, logs, "role=actor", "index=0", config,
                                 *SMALL_JOB, out=tmp_path / "submit-first.log")  # fmt: skip
    first, late = "actor-0-" + os.uname().nodename, "actor-1-" + os.uname().nodename
    try:
        wait_until(
            lambda: all(status(run_dir)["models"][m]["version"] >= 1 for m in MODELS),
            300, "the run never reached version 1", broker,
        )  # fmt: skip
        (first_job,) = [
            j["JobId"] for j in slurm_cluster.jobs_logging_to(logs) if j["JobName"] == "drmas-actor"
        ]
        submitters["late"] = submit(slurm_cluster, logs, "role=actor", "index=1", config,
                                    *SMALL_JOB, out=tmp_path / "submit-late.log")  # fmt: skip
        worked = wait_until(
            lambda: (a := actor(run_dir, late)) and a["groups_done"] > 0 and a,
            240, "the late actor never returned an accepted group", broker,
        )  # fmt: skip
        assert all(worked["versions"][m] >= 1 for m in MODELS), worked  # synced first
        preempted = slurm_cluster.run("scancel", "--signal=TERM", first_job)
        assert preempted.returncode == 0, preempted.stderr
        wait_until(lambda: not actor(run_dir, first), 60, "the broker still lists it", broker)
        now = {m: status(run_dir)["models"][m]["version"] for m in MODELS}
        wait_until(
            lambda: all(status(run_dir)["models"][m]["version"] > now[m] for m in MODELS),
            240, f"the late actor alone did not move the run past {now}", broker,
        )  # fmt: skip
        broker.send_signal(signal.SIGTERM)  # the operator stops the run
        wait_all(list(submitters.values()), 420)
        broker.wait(120)
        jobs = slurm_cluster.wait_ended(logs, 4, timeout=60)
    finally:
        for proc in [*submitters.values(), broker]:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        for log in sorted(tmp_path.glob("*.log")):
            print(f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}")
        print(job_logs(logs, tail=2500))
    assert {k: p.returncode for k, p in submitters.items()} == dict.fromkeys(submitters, 0)
    assert broker.returncode == 0
    assert sorted(j["JobState"] for j in jobs) == ["COMPLETED"] * 4  # the preempted one too

    summary = read_summary(run_dir)
    c = check_accounting(summary, batch_groups=2)
    assert c["actors_joined"] == 2 and c["actors_synced_on_attach"] == 1, c
    assert c["actors_left"] >= 1 and c.get("actors_lost", 0) == 0, c  # it said Goodbye
    broker_log = (tmp_path / "broker.log").read_text()
    assert f"actor {first} removed (left)" in broker_log
    assert f"actor {first} stopped (signal 15); handed back" in job_logs(logs)
