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
from typing import Any

import pytest

from drmas.broker.state import BrokerState
from drmas.config import load_config
from drmas.protocol.messages import NoBatch
from drmas.tasks.source import TaskSource
from tests.integration.conftest import (
    HELD_OPEN,
    REPO,
    broker_address,
    check_accounting,
    read_summary,
    start_train,
    status,
    stop_all,
    stop_run,
    versions,
    wait_for,
)
from tests.integration.test_supervision import drmas_children_of

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
    st.weights.done("solver", 2, 0.1, ok=True)  # its PublishDone: the ok is taken now
    # ... and only once the actor holds v2 does it get leases
    assert st.lease("late", 1, {"solver": 2, "verifier": 0}, 0.0).leases
    assert st.counters["actors_synced_on_attach"] == 1


# ---------------------------------------------------------------- real runs
# Both runs are held open (HELD_OPEN) until their checks are done, then stopped as a user
# would: a late actor can never find the run already over, however loaded the machine.


def advanced(address: str, run: subprocess.Popen[str], by: int = 1) -> dict[str, int]:
    """Wait until every model is `by` versions past where it is now: the run goes on."""
    now = versions(address)
    return wait_for(
        lambda: (v := versions(address)) and all(v[m] >= now[m] + by for m in MODELS) and v,
        300,
        f"the run did not move {by} version(s) past {now}",
        run,
    )


@pytest.mark.slow
def test_actor_attached_mid_run_syncs_then_trains(tmp_path: Path, model_cache: Path) -> None:
    """hf engine: a second actor attached once both models are past v1 shows in status,
    receives the current weights (digests match), and then contributes accepted groups,
    although its config names a tracker (wandb) that is not installed on its node.
    Then Ctrl-C (SIGINT) stops the run: drmas train stops every process it started, and
    the broker's Shutdown reaches the attached actor too, which stops cleanly."""
    run_dir = tmp_path / "run"
    train = start_train(
        run_dir, model_cache, "train.progress=false", HELD_OPEN, "actor.max_groups=2"
    )
    late = None
    try:
        address = broker_address(run_dir)

        def past_v1() -> bool:
            models = status(address)["models"]
            return all(models[m]["version"] >= 1 for m in MODELS)

        wait_for(past_v1, 240, "the run never reached version 1", train)
        assert len(drmas_children_of(run_dir)) == 4  # broker, 2 learners, 1 actor
        # the run's broker writes jsonl; this node's config also names wandb, which only the
        # broker would load: an actor must start without it (CI has no wandb installed)
        late = start_actor(run_dir, address, "late", "logger=[jsonl,wandb]")
        seen = wait_for(
            lambda: actor_status(address, "late"), 180, "late actor not in status", train
        )
        assert seen["host"] and seen["pid"] == late.pid
        worked = wait_for(
            lambda: (a := actor_status(address, "late")) and a["groups_done"] > 0 and a,
            240,
            "the late actor never returned an accepted group",
            train,
        )
        assert all(worked["versions"][m] >= 1 for m in MODELS), worked  # synced first
        out = stop_run(train, signal.SIGINT)
        assert "interrupted; stopping all processes" in out, out[-2000:]
        late.wait(timeout=60)  # the broker's Shutdown reaches the attached actor too
        assert late.returncode == 0, (run_dir / "extra-late.log").read_text()[-4000:]
    finally:
        stop_all(train, late)
    assert drmas_children_of(run_dir) == []
    summary = read_summary(run_dir)
    c = check_accounting(summary)
    assert c["actors_joined"] == 2 and c["actors_synced_on_attach"] == 1, c
    # every load was verified against the learner's fingerprint, the late actor's too
    assert c["weight_digest_match"] == c["weight_loads"] >= sum(summary["versions"].values()), c
    log = (run_dir / "extra-late.log").read_text()
    # drmas train passes the stop on to its children as SIGTERM
    assert "stopped (broker: the broker was stopped (SIGTERM))" in log, log[-2000:]


@pytest.mark.slow
def test_sigterm_detach_hands_back_leases_and_sim_actors_complete(
    tmp_path: Path, model_cache: Path
) -> None:
    """An actor stopped with SIGTERM says Goodbye with its unfinished leases: they are handed
    back (not lost to a heartbeat timeout) and the run goes on with nothing lost. The
    run's own two actors use the `sim` engine: both load every publish and the run writes
    one metrics line per step (one run for both checks: each run costs CI a minute)."""
    run_dir = tmp_path / "run"
    train = start_train(
        run_dir,
        model_cache,
        "train.progress=false",
        HELD_OPEN,
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
            240,
            "the extra actor never held a lease",
            train,
        )
        leaver.send_signal(signal.SIGTERM)
        assert leaver.wait(timeout=60) == 0
        wait_for(
            lambda: not actor_status(address, "leaver"),
            120,
            "the broker still lists the leaver",
            train,
        )
        advanced(address, train, by=2)  # what the leaver handed back was trained on
        stop_run(train)
    finally:
        stop_all(train, leaver)
    summary = read_summary(run_dir)
    c = check_accounting(summary)
    # the leaver left cleanly (the run's own actors say Goodbye too when the run is stopped)
    assert c["actors_left"] >= 1 and c.get("actors_lost", 0) == 0, c
    assert "actor leaver removed (left)" in (run_dir / "logs" / "broker.log").read_text()
    assert c["leases_handed_back"] >= 1 and c.get("leases_reissued", 0) == 0, c
    assert "handed back" in (run_dir / "extra-leaver.log").read_text()
    # the sim actors: the run's two and the leaver joined; the two loaded every publish
    # (but the last of each model, which the stop may have cut short). On a loaded machine
    # an actor stuck in a roll call can miss publishes and be dropped ("never joined"):
    # it then says Hello once more, and only once (a second Hello would re-register it)
    assert c["actors_joined"] == 3 + c.get("actors_never_joined", 0), c
    assert c.get("actors_re_registered", 0) == 0, c
    published = sum(summary["versions"].values())
    assert c["weight_digest_match"] >= 2 * (published - len(MODELS)), c
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = [x["step"] for x in lines if "val/tasks" not in x]
    assert len(steps) >= 3 and steps == list(range(1, len(steps) + 1)), steps
