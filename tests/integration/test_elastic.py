"""Elastic actors (docs/deploy.md): attach mid-run, leave cleanly, and the `sim` engine end to end.

The attach rule is checked first on BrokerState alone, then with real processes: a
`drmas train` run plus an extra `drmas actor --config RUN_DIR/config.yaml` that this test
starts (and stops) itself.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, TypeVar

import pytest

from drmas.broker.state import BrokerState
from drmas.config import load_config
from drmas.protocol.messages import NoBatch
from drmas.tasks.source import TaskSource
from tests.integration.conftest import (
    REPO,
    broker_address,
    finish,
    read_summary,
    start_train,
    status,
    stop_all,
    wait_for,
)

T = TypeVar("T")
MODELS = ["solver", "verifier"]


# ----------------------------------------------------------------------- helpers


def start_actor(run_dir: Path, address: str, actor_id: str, *extra: str) -> subprocess.Popen[str]:
    """`drmas actor` attached to a running job, as a user would type it."""
    log = (run_dir / f"extra-{actor_id}.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "drmas.launch.cli", "actor", "--config",
         str(run_dir / "config.yaml"), f"broker.address={address}", *extra, "--id", actor_id],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def actor_status(address: str, actor_id: str) -> dict[str, Any]:
    return {a["client_id"]: a for a in status(address)["actors"]}.get(actor_id, {})


def check_complete(summary: dict[str, Any], steps: int) -> dict[str, int]:
    """Nothing lost, nothing counted twice: every batch full, every lease ended once."""
    c = summary["counters"]
    assert summary["done"] is True
    assert summary["leases"]["balanced"] == 1, summary["leases"]
    assert summary["leases"]["outstanding"] == 0, summary["leases"]
    assert c.get("groups_trained_twice", 0) == 0
    assert c.get("weight_digest_mismatch", 0) == 0
    for model in MODELS:
        assert summary["trained_groups"][model] == steps * 4  # train.steps × batch_groups
    return c


# ------------------------------------------------------------- the rule alone
def test_an_actor_attached_mid_run_gets_weights_before_leases() -> None:
    cfg = load_config(["group_size=2", "batch_groups=2", "train.steps=5", "val.every=0"])
    st = BrokerState(cfg, TaskSource(cfg.task))
    st.add_actor("early", "h", 1, MODELS, 0.0)  # at version 0: nothing to wait for
    assert st.lease("early", 1, {}, 0.0).leases
    st.versions["solver"] = 2  # the solver's learner has taken two steps
    st.add_actor("late", "h", 2, MODELS, 0.0)
    refused = st.lease("late", 4, {"solver": 0, "verifier": 0}, 0.0)
    assert refused.leases == [] and "solver v0 < v2" in refused.reason
    # the learner, idle at v2, is told to re-publish to the stale actor ...
    reply = st.batch("solver", 0, 1, 2, 0.0)
    assert isinstance(reply, NoBatch) and reply.republish
    plan, joins = st.weights.plan("solver", 2, "127.0.0.1:1", now=0.0)
    assert "late" in plan.members and "late" in [cid for cid, _ in joins]
    st.weights.loaded("late", "solver", 2, ok=True)
    # ... and only once the actor holds v2 does it get leases
    assert st.lease("late", 1, {"solver": 2, "verifier": 0}, 0.0).leases
    assert st.counters["actors_synced_on_attach"] == 1


# ---------------------------------------------------------------- real runs
@pytest.mark.slow
def test_actor_attached_mid_run_syncs_then_trains(tmp_path: Path, model_cache: Path) -> None:
    """hf engine: a second actor attached once both models are past v1 shows in status,
    receives the current weights (digests match), and then contributes accepted groups,
    although its config names a tracker (wandb) that is not installed on its node."""
    # 30 steps: the late actor takes ~20-30 s to start on a loaded machine, and 12 steps
    # took 33 s in one run, which ended before the late actor said Hello (CI saw that at 8
    # steps, then at 12)
    run_dir, steps = tmp_path / "run", 30
    train = start_train(
        run_dir, model_cache, "train.progress=false", f"train.steps={steps}", "actor.max_groups=2"
    )
    late = None
    try:
        address = broker_address(run_dir)

        def past_v1() -> bool:
            models = status(address)["models"]
            return all(models[m]["version"] >= 1 for m in MODELS)

        wait_for(past_v1, 240, "the run never reached version 1", train)
        # the run's broker writes jsonl; this node's config also names wandb, which only the
        # broker would load: an actor must start without it (CI has no wandb installed)
        late = start_actor(run_dir, address, "late", "logger=[jsonl,wandb]")
        seen = wait_for(
            lambda: actor_status(address, "late"), 120, "late actor not in status", train
        )
        assert seen["host"] and seen["pid"] == late.pid
        worked = wait_for(
            lambda: (a := actor_status(address, "late")) and a["groups_done"] > 0 and a,
            180,
            "the late actor never returned an accepted group",
            train,
        )
        assert all(worked["versions"][m] >= 1 for m in MODELS), worked  # synced first
        finish(train)
        late.wait(timeout=60)  # the broker's Shutdown reaches the attached actor too
        assert late.returncode == 0, (run_dir / "extra-late.log").read_text()[-4000:]
    finally:
        stop_all(train, late)
    c = check_complete(read_summary(run_dir), steps)
    assert c["actors_joined"] == 2 and c["actors_synced_on_attach"] == 1, c
    # every load was verified against the learner's fingerprint: more loads than the
    # single built-in actor alone could make (steps × models)
    assert c["weight_digest_match"] > steps * len(MODELS), c
    log = (run_dir / "extra-late.log").read_text()
    assert "stopped (broker: training finished)" in log, log[-2000:]


@pytest.mark.slow
def test_sigterm_detach_hands_back_leases_and_sim_actors_complete(
    tmp_path: Path, model_cache: Path
) -> None:
    """An actor stopped with SIGTERM says Goodbye with its unfinished leases: they are handed
    back (not lost to a heartbeat timeout) and the run completes with nothing lost. The
    run's own two actors use the `sim` engine: both load every publish and the run ends
    with one metrics line per step (one run for both checks: each run costs CI a minute)."""
    run_dir, steps = tmp_path / "run", 12  # long enough for the leaver to start (20-30 s)
    train = start_train(
        run_dir,
        model_cache,
        "train.progress=false",
        f"train.steps={steps}",
        "actor.engine.name=sim",
        "actor.num_actors=2",
        "actor.max_groups=2",
    )
    leaver = None
    try:
        address = broker_address(run_dir)
        # slow sim decoding: its groups stay unfinished for seconds
        leaver = start_actor(run_dir, address, "leaver", "actor.engine.sim_token_latency_s=0.1")
        wait_for(
            lambda: actor_status(address, "leaver").get("leases", 0) > 0,
            180,
            "the extra actor never held a lease",
            train,
        )
        leaver.send_signal(signal.SIGTERM)
        assert leaver.wait(timeout=30) == 0
        gone = wait_for(
            lambda: not actor_status(address, "leaver"), 10, "the broker still lists the leaver"
        )
        assert gone
        finish(train)
    finally:
        stop_all(train, leaver)
    c = check_complete(read_summary(run_dir), steps)
    # the leaver left cleanly (the run's own actors may also say Goodbye after the Shutdown,
    # if they reach the broker before the learners are done saving)
    assert c["actors_left"] >= 1 and c.get("actors_lost", 0) == 0, c
    assert "actor leaver removed (left)" in (run_dir / "logs" / "broker.log").read_text()
    assert c["leases_handed_back"] >= 1 and c.get("leases_reissued", 0) == 0, c
    assert "handed back" in (run_dir / "extra-leaver.log").read_text()
    # the sim actors: the run's two and the leaver joined; the two loaded every publish
    assert c["actors_joined"] == 3, c
    assert c["weight_digest_match"] >= 2 * steps * len(MODELS), c
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    assert [x["step"] for x in lines if "val/tasks" not in x] == list(range(1, steps + 1))
