"""Learners keep their seats in a real run: an extra learner claiming rank 0 without the
run's learner secret and another claiming rank 1 with it, with fresh ids, are refused, as
is everything they send next, and the run finishes with nothing lost or trained twice
(issue #25: such a Hello replaced the real rank 0, whose next request was refused, and
the run stopped; rank 1 could move the version; the intruder's publish pointed the actors
at its own store. Issue #36: a free seat went to whoever said Hello first)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from drmas.protocol.messages import (
    BatchRequest,
    BatchShard,
    NoBatch,
    PublishRequest,
    StatusReply,
    StatusRequest,
    StepReport,
    WeightGroupPlan,
)
from drmas.transports.channel import BrokerClient, BrokerRefused
from drmas.transports.learner_secret import proof
from tests.integration.conftest import broker_address, finish, read_summary, start_train

pytestmark = pytest.mark.slow

MODEL = "policy"  # experiment=tiny_math_shared: one model, here two learner ranks
STEPS = 4  # FAST's train.steps
GROUPS_PER_STEP = 4  # FAST's batch_groups


def squat_until_seated(
    squatter: BrokerClient, watch: BrokerClient, run: subprocess.Popen[str], timeout: float = 420
) -> tuple[StatusReply, int]:
    """From the moment the broker answers until both real ranks hold their seats, the
    squatter asks for rank 0 and rank 1 in turn without the run's secret (issue #36: the
    first Hello for a free seat took it, and the real learner was refused). Returns the
    status once both sat (training is then still going on) and how many Hellos it sent."""
    deadline, attempts = time.monotonic() + timeout, 0
    while time.monotonic() < deadline:
        assert run.poll() is None, "drmas train ended before its learners sat"
        with pytest.raises(BrokerRefused) as err:
            squatter.hello("learner", [MODEL], rank=attempts % 2, world_size=2, timeout_s=30)
        assert err.value.code == "forbidden", err.value
        assert "did not prove it is a learner of this run" in str(err.value), err.value
        attempts += 1
        status = watch.request(StatusRequest(), StatusReply, 30)
        if status.models[MODEL].learner_ranks == 2:
            return status, attempts
        time.sleep(0.6)  # the broker answers one client's status at most twice a second
    raise TimeoutError("the run's two learner ranks never registered")


def test_extra_learners_claiming_rank_0_and_1_are_refused_and_the_run_loses_nothing(
    tmp_path: Path, model_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    train = start_train(
        run_dir, model_cache, "experiment=tiny_math_shared",
        "models.policy.warmstart.steps=60", "learner.world_size=2",
    )  # fmt: skip
    clients: list[BrokerClient] = []
    try:
        address = broker_address(run_dir)
        watch = BrokerClient(address, "seat-watch")
        squatter = BrokerClient(address, "squatter")
        clients += [watch, squatter]
        status, squats = squat_until_seated(squatter, watch, train)
        version = status.models[MODEL].version
        assert version < STEPS, "the run was over before the extra learners came"
        # rank 0's claimant has no proof (any client: issue #36); rank 1's read the run's
        # secret, as a second learner process of the run would, and finds the seat held
        secret = (run_dir / "learner.secret").read_text().strip().encode()
        for rank, why in ((0, "did not prove it is a learner of this run"),
                          (1, f"is held by 'learner-{MODEL}-1'")):  # fmt: skip
            extra = BrokerClient(address, f"extra-{MODEL}-{rank}")
            clients.append(extra)
            given = proof(secret, extra.client_id, MODEL, rank) if rank else ""
            with pytest.raises(BrokerRefused) as err:
                extra.hello("learner", [MODEL], rank=rank, world_size=2, timeout_s=30, proof=given)
            assert err.value.code == "forbidden", err.value
            assert why in str(err.value), err.value
        extra0, extra1 = clients[2], clients[3]
        # what the intruder did next: publish from its own store, move the version
        with pytest.raises(BrokerRefused) as err:
            extra0.request(PublishRequest(MODEL, version, "127.0.0.1:1"), WeightGroupPlan, 30)
        assert err.value.code == "unknown_client", err.value
        ahead = BatchRequest(extra1.client_id, MODEL, 1, 2, version + 1)
        for _ in range(8):
            with pytest.raises(BrokerRefused) as err:
                extra1.request(ahead, (BatchShard, NoBatch), 30)
            assert err.value.code == "unknown_client", err.value
        extra0.send(StepReport(MODEL, version + 1, {}))
        after = watch.request(StatusRequest(), StatusReply, 30)
        assert after.models[MODEL].learner_ranks == 2
        assert after.counters["refused/forbidden"] == 2 + squats, after.counters
        out = finish(train)
    finally:
        for client in clients:
            client.close()
        if train.poll() is None:
            train.terminate()  # drmas train stops its children on SIGTERM
            train.wait(timeout=60)
    assert "no longer knows this learner" not in out
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert summary["done"] and summary["versions"] == {MODEL: STEPS}, summary
    assert c["refused/forbidden"] == 2 + squats and c["refused/unknown_client"] >= 10, c
    assert c.get("learners_lost", 0) == 0 and c.get("groups_trained_twice", 0) == 0, c
    assert c[f"batches_trained/{MODEL}"] == STEPS, c
    assert summary["trained_groups"] == {MODEL: STEPS * GROUPS_PER_STEP}, summary
    assert summary["leases"]["balanced"] == 1, summary["leases"]
