"""Hostile and broken clients against a real broker loop on loopback: every case is
refused, counted and answered, and the broker goes on. Each case here crashed the broker
or changed its state before the gate (drmas/broker/gate.py) existed."""

from __future__ import annotations

import logging
import re
import selectors
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from drmas.broker.connections import ConnectionCap
from drmas.broker.server import BrokerServer
from drmas.broker.status import lease_accounting
from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode, pack_ids, pack_logprobs
from drmas.protocol.codec import ProtocolError, decode_to_broker
from drmas.protocol.messages import (
    Accepted,
    BatchRequest,
    BatchShard,
    Episode,
    ErrorReply,
    Goodbye,
    GroupResult,
    Heartbeat,
    Hello,
    JoinWeightGroup,
    Lease,
    LeaseRequest,
    LeaseReturn,
    Leases,
    NoBatch,
    PublishDone,
    PublishRequest,
    StatusReply,
    StatusRequest,
    Step,
    StepReport,
    WeightGroupPlan,
    WeightsLoaded,
    Welcome,
    pack_group,
)
from tests.fixtures.broker_server import broker_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with broker_server(tmp_path, "broker.max_actors=8") as srv:
        yield srv


class Peer:
    """A DEALER client with its own identity; `ask` pumps the broker until a reply comes."""

    def __init__(self, server: BrokerServer, cid: str) -> None:
        self.server, self.cid = server, cid
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, cid.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(server.address)

    def send(self, msg: Any) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else encode(msg))

    def ask(self, msg: Any, timeout: float = 5.0) -> Any:
        self.send(msg)
        return self.next(timeout)

    def next(self, timeout: float = 5.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.sock.poll(20):
                self.server.drain()
            if self.sock.poll(0):
                return decode_from_broker(self.sock.recv())
        return None

    def hello(self, role: str, models: list[str], **kw: Any) -> Any:
        return self.ask(Hello(role=role, client_id=self.cid, protocol_version=PROTOCOL_VERSION,
                              models=models, **kw))  # type: ignore[arg-type]  # fmt: skip

    def close(self) -> None:
        self.sock.close(linger=0)


def refused(reply: Any, code: str) -> bool:
    return isinstance(reply, ErrorReply) and reply.code == code


def deep_frame(depth: int = 1000) -> bytes:
    """~1 KB: an unknown key holding an array nested `depth` levels, before `type`."""
    return (b"\x82" + msgpack.packb("x") + b"\x91" * depth + b"\xc0"
            + msgpack.packb("type") + msgpack.packb("status_request"))  # fmt: skip


# ------------------------------------------------------------------ crashes
def test_a_deeply_nested_frame_is_refused_by_both_decoders(server: BrokerServer) -> None:
    frame = deep_frame()
    assert len(frame) < 1100
    for decode in (decode_to_broker, decode_from_broker):
        with pytest.raises(ProtocolError, match="nested too deeply"):
            decode(frame)
    peer = Peer(server, "x")
    assert refused(peer.ask(frame), "bad_frame")
    assert server.state.counters["refused/bad_frame"] == 1
    assert isinstance(peer.ask(StatusRequest()), StatusReply)  # still serving


def test_learner_messages_for_unknown_models_or_ranks_are_refused(server: BrokerServer) -> None:
    learner = Peer(server, "L")
    assert isinstance(learner.hello("learner", ["solver"], rank=0, world_size=1), Welcome)
    cases = [
        (BatchRequest("L", "nope", 0, 1, 0), "forbidden"),  # unknown model: KeyError before
        (BatchRequest("L", "verifier", 0, 1, 0), "forbidden"),  # another model's
        (BatchRequest("L", "solver", 0, 2, 0), "forbidden"),  # world size it did not say
        (BatchRequest("L", "solver", 5, 1, 0), "forbidden"),  # rank out of range
        (BatchRequest("L", "solver", 0, 0, 0), "forbidden"),  # world size 0
        (BatchRequest("L", "solver", 0, 1, 7), "invalid"),  # beyond train.steps
        (LeaseRequest("L", 1, {}), "forbidden"),  # a learner is not an actor: KeyError before
    ]
    for msg, code in cases:
        assert refused(learner.ask(msg), code), msg
    learner.send(StepReport("nope", 1, {}))  # fire-and-forget: the error reply still comes
    assert refused(learner.next(), "forbidden")
    assert isinstance(learner.ask(BatchRequest("L", "solver", 0, 1, 0)), NoBatch)  # alive
    assert sum(v for k, v in server.state.counters.items() if k.startswith("refused/")) == 8


def test_a_batch_cut_for_another_world_size_is_refused_not_fatal(server: BrokerServer) -> None:
    from tests.unit.test_broker_state import result

    st = server.state
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    for lease in st.lease("a", 2, {}, time.monotonic()).leases:
        assert st.accept("a", result(lease), time.monotonic()) == ""
    assert st.batch("solver", 0, 2, 0, 0.0).rank == 0  # cut for two ranks
    learner = Peer(server, "L")  # a restarted group of one rank asks for it
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    assert refused(learner.ask(BatchRequest("L", "solver", 0, 1, 0)), "invalid")


# ------------------------------------------------------------ roles
def test_an_actor_cannot_plan_a_publish_or_report_steps(server: BrokerServer) -> None:
    victim, forger = Peer(server, "victim"), Peer(server, "forger")
    for peer in (victim, forger):
        assert isinstance(peer.hello("actor", ["solver", "verifier"]), Welcome)
    st = server.state
    assert refused(forger.ask(PublishRequest("solver", 0, "127.0.0.1:1")), "forbidden")
    assert victim.next(0.3) is None  # no JoinWeightGroup pointing at the forger's store
    forger.send(PublishDone("solver", 0, 0.1, 10, digest="d"))
    forger.send(StepReport("solver", 2_000_000, {}))
    forger.send(BatchRequest("forger", "solver", 0, 1, 0))
    for _ in range(3):
        assert refused(forger.next(), "forbidden")
    assert st.versions == {"solver": 0, "verifier": 0} and not st.validation.queue
    assert st.counters["weight_publishes"] == 0


def test_versions_beyond_what_was_published_are_refused(server: BrokerServer) -> None:
    actor, learner = Peer(server, "a"), Peer(server, "L")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    st = server.state
    actor.send(Heartbeat("a", {"solver": 1_000_000}))
    assert refused(actor.next(), "invalid")
    assert st.table.actors["a"].versions == {}  # not stored: staleness admission holds
    assert refused(actor.ask(LeaseRequest("a", 1, {"solver": 5})), "invalid")
    actor.send(WeightsLoaded("a", "solver", 9, 0.1, digest="x"))  # nothing was planned
    assert refused(actor.next(), "invalid")
    learner.send(StepReport("solver", 2_000_000, {}))
    assert refused(learner.next(), "invalid")
    learner.send(StepReport("solver", 0, {}))  # not the next version either
    assert refused(learner.next(), "invalid")
    assert st.versions["solver"] == 0 and not st.metrics.pending
    learner.send(StepReport("solver", 1, {}))  # the next version: accepted, no reply
    assert learner.next(0.3) is None and st.versions["solver"] == 1


def test_actor_times_in_heartbeats_are_checked_then_become_step_fractions(
    server: BrokerServer,
) -> None:
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    metrics = server.state.metrics
    for bad in ({"sleeping": 1.0}, {"generating": -1.0}, {"generating": float("nan")},
                {"generating": 1e12}):  # fmt: skip
        actor.send(Heartbeat("a", {}, 0, bad))
        assert refused(actor.next(), "invalid"), bad
    assert metrics._actor_fractions() == {}  # nothing refused was kept
    actor.send(Heartbeat("a", {}, 1, {"generating": 3.0, "waiting_for_leases": 1.0}))
    assert actor.next(0.3) is None  # accepted: heartbeats get no reply
    assert metrics._actor_fractions() == {
        "actors/generating": 0.75, "actors/waiting_for_leases": 0.25,
        "actors/loading_weights": 0.0,
    }  # fmt: skip
    actor.send(Heartbeat("a", {}, 1, {"generating": 4.0, "waiting_for_leases": 4.0}))
    assert actor.next(0.3) is None
    fractions = metrics._actor_fractions()  # only what came since the previous line
    assert fractions["actors/generating"] == 0.25 and fractions["actors/waiting_for_leases"] == 0.75
    server.state.drop_actor("a", "left")
    assert metrics._actor_fractions() == {}


def test_observers_only_read_status(server: BrokerServer) -> None:
    ops = Peer(server, "ops")
    assert isinstance(ops.hello("client", []), Welcome)
    assert isinstance(ops.ask(StatusRequest()), StatusReply)
    assert refused(ops.ask(LeaseRequest("ops", 1, {})), "unknown_client")
    assert refused(ops.hello("client", ["solver"]), "invalid")
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    assert refused(actor.hello("learner", ["solver"]), "forbidden")  # an id keeps its role


# ----------------------------------------------------------------- bounds
def test_learner_registrations_stay_one_per_rank(server: BrokerServer) -> None:
    holder = Peer(server, "L")
    assert isinstance(holder.hello("learner", ["solver"], rank=0, world_size=2), Welcome)
    for i in range(100):
        peer = Peer(server, f"L{i}")  # new ids claiming the held seat
        assert refused(peer.hello("learner", ["solver"], rank=0, world_size=2), "forbidden")
        peer.close()
    assert list(server.state.learners) == ["L"]
    assert server.state.counters["refused/forbidden"] == 100
    odd = Peer(server, "odd")
    assert refused(odd.hello("learner", ["solver"], rank=1, world_size=3), "invalid")
    assert refused(odd.hello("learner", ["solver"], rank=0, world_size=10**6), "invalid")


# ------------------------------------------------------------------ seats
def test_a_held_seat_is_refused_not_swapped_in_until_goodbye_or_timeout(
    server: BrokerServer,
) -> None:
    """Issue #25: a fresh id saying Hello as solver rank 0 replaced the real learner, whose
    next request was refused as unknown_client, and its PublishRequest then pointed the
    actors at the intruder's store."""
    st = server.state
    real, rank1, actor = Peer(server, "learner-solver-0"), Peer(server, "L1"), Peer(server, "a")
    assert isinstance(real.hello("learner", ["solver"], rank=0, world_size=2), Welcome)
    assert isinstance(rank1.hello("learner", ["solver"], rank=1, world_size=2), Welcome)
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    intruder = Peer(server, "intruder")
    for rank in (0, 1):
        reply = intruder.hello("learner", ["solver"], rank=rank, world_size=2)
        assert refused(reply, "forbidden") and "is held by" in reply.reason, reply
    # not registered: everything it sends next is refused, and no actor hears of its store
    assert refused(intruder.ask(PublishRequest("solver", 0, "10.6.6.6:1")), "unknown_client")
    assert refused(intruder.ask(BatchRequest("intruder", "solver", 0, 2, 0)), "unknown_client")
    assert actor.next(0.3) is None and st.counters["weight_publishes"] == 0
    # the real ranks keep their seats and are served
    assert sorted(st.learners) == ["L1", "learner-solver-0"]
    assert isinstance(real.ask(BatchRequest("learner-solver-0", "solver", 0, 2, 0)), NoBatch)
    # a rank restarting under its own id takes its seat back; a holder cannot change seat
    assert isinstance(real.hello("learner", ["solver"], rank=0, world_size=2), Welcome)
    reply = rank1.hello("learner", ["solver"], rank=0, world_size=2)
    assert refused(reply, "forbidden") and "keeps its seat" in reply.reason
    # Goodbye frees a seat; so does broker.learner_timeout_s of silence
    real.send(Goodbye("learner-solver-0"))
    assert real.next(0.3) is None
    assert isinstance(intruder.hello("learner", ["solver"], rank=0, world_size=2), Welcome)
    st.reap(time.monotonic() + server.cfg.broker.learner_timeout_s + 1)
    assert not st.learners and st.counters["learners_lost"] == 2
    assert isinstance(
        Peer(server, "L2").hello("learner", ["solver"], rank=1, world_size=2), Welcome
    )


def test_only_rank_0_moves_a_version(server: BrokerServer) -> None:
    """Issue #25: eight BatchRequests of rank 1 took the solver from v0 to v6. Rank 1 moves
    no version and cuts no batch: it gets its shard of the batch rank 0 took."""
    from tests.unit.test_broker_state import result

    st = server.state
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    for lease in st.lease("a", 2, {}, 0.0).leases:  # one batch of B = 2 groups
        assert st.accept("a", result(lease), 0.0) == ""
    rank0, rank1 = Peer(server, "L0"), Peer(server, "L1")
    assert isinstance(rank0.hello("learner", ["solver"], rank=0, world_size=2), Welcome)
    assert isinstance(rank1.hello("learner", ["solver"], rank=1, world_size=2), Welcome)
    for _ in range(8):
        reply = rank1.ask(BatchRequest("L1", "solver", 1, 2, st.versions["solver"] + 1))
        assert refused(reply, "invalid") and "only rank 0" in reply.reason, reply
    reply = rank1.ask(BatchRequest("L1", "solver", 1, 2, 0))
    assert isinstance(reply, NoBatch) and "rank 0 has not taken v0" in reply.reason
    assert not st.buffers["solver"].cut and len(st.buffers["solver"].slices) == 2
    rank1.send(StepReport("solver", 1, {}))
    assert refused(rank1.next(), "forbidden")
    assert st.versions == {"solver": 0, "verifier": 0}
    shards = [rank0.ask(BatchRequest("L0", "solver", 0, 2, 0)),
              rank1.ask(BatchRequest("L1", "solver", 1, 2, 0))]  # fmt: skip
    assert [(s.rank, s.version) for s in shards] == [(0, 0), (1, 0)]
    assert isinstance(rank0.ask(BatchRequest("L0", "solver", 0, 2, 1)), NoBatch)
    assert st.versions["solver"] == 1  # rank 0 asking for v1 has trained v0


def solver_groups(batch: Any) -> list[int]:
    return [part.group_id for part in batch.slices]


def test_an_older_version_is_served_only_while_its_batch_is_still_cut(
    server: BrokerServer,
) -> None:
    """Issue #25: a request for a version the broker had moved past cut a new batch, and
    the next step report counted it as trained: 6 groups trained, 4 sent. Now it is
    refused unless that batch is still cut, and trained means sent to the learner."""
    from tests.unit.test_broker_state import result

    st = server.state
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    for lease in st.lease("a", 6, {}, 0.0).leases:  # (η + 1) · B = 4 groups, 2 batches
        assert st.accept("a", result(lease), 0.0) == ""
    buf = st.buffers["solver"]
    learner = Peer(server, "L")
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    shard = learner.ask(BatchRequest("L", "solver", 0, 1, 0))
    assert isinstance(shard, BatchShard) and shard.version == 0
    sent = {0: solver_groups(buf.cut[0])}
    learner.send(StepReport("solver", 1, {}))
    assert learner.next(0.3) is None and st.versions["solver"] == 1
    reply = learner.ask(BatchRequest("L", "solver", 0, 1, 0))  # v0 again: trained, not re-cut
    assert refused(reply, "invalid") and "not cut again" in reply.reason
    assert len(buf.slices) == 2 and not buf.cut and buf.batches_cut == 1
    shard = learner.ask(BatchRequest("L", "solver", 0, 1, 1))
    assert isinstance(shard, BatchShard) and shard.version == 1
    sent[1] = solver_groups(buf.cut[1])
    assert isinstance(learner.ask(BatchRequest("L", "solver", 0, 1, 2)), NoBatch)  # rank 0 moves
    again = learner.ask(BatchRequest("L", "solver", 0, 1, 1))  # v1 is still cut: served again
    assert isinstance(again, BatchShard) and again.samples == shard.samples
    learner.send(StepReport("solver", 3, {}))
    assert learner.next(0.3) is None
    assert st.trained_groups["solver"] == set(sent[0]) | set(sent[1])
    assert len(st.trained_groups["solver"]) == 4 and not set(sent[0]) & set(sent[1])
    assert st.counters["groups_trained_twice"] == 0 and st.counters["batches_trained/solver"] == 2
    assert [e[2] for e in st.trained_log] == [*sent[0], *sent[1]]


def test_a_key_binding_allows_its_roles_and_learner_models_only(server: BrokerServer) -> None:
    """With CURVE the loop passes what the sender's key is bound to (authorized/roles.json,
    drmas/transports/security.py): roles, "learner:<model>", or nothing at all."""
    gate = server.gate
    solver_only = frozenset({"learner:solver"})
    gate.check_key("learner", solver_only, ["solver"])
    gate.check_key("learner", frozenset({"learner"}), ["verifier"])  # any model
    gate.check_key("actor", frozenset({"actor", "learner", "client"}), ["solver", "verifier"])
    cases = [
        ("learner", solver_only, ["verifier"], "bound to the learners of ['solver']"),
        ("actor", solver_only, ["solver", "verifier"], "not allowed the actor role"),
        ("client", frozenset({"actor"}), [], "not allowed the observer role"),
        ("learner", frozenset(), ["solver"], "no binding"),
    ]
    for role, grants, models, reason in cases:
        with pytest.raises(ProtocolError, match=re.escape(reason)) as err:
            gate.check_key(role, grants, models)
        assert err.value.code == "forbidden"
    peer = Peer(server, "v")
    hello = Hello("learner", "v", PROTOCOL_VERSION, ["verifier"])
    with pytest.raises(ProtocolError, match="not of"):
        gate.admit("v", hello, solver_only)
    with pytest.raises(ProtocolError, match="no binding"):  # an unbound key reads nothing
        gate.admit("v", StatusRequest(), frozenset())
    assert gate.admit("v", StatusRequest(), frozenset({"actor"})).sender is None
    assert gate.admit("v", hello, frozenset({"learner:verifier"})).sender is None
    peer.close()


def test_silent_learners_are_reaped(server: BrokerServer) -> None:
    peer = Peer(server, "L")
    assert isinstance(peer.hello("learner", ["solver"]), Welcome)
    server.state.reap(time.monotonic() + server.cfg.broker.learner_timeout_s + 1)
    assert not server.state.learners and server.state.counters["learners_lost"] == 1
    assert refused(peer.ask(BatchRequest("L", "solver", 0, 1, 0)), "unknown_client")


def test_actor_count_is_capped(server: BrokerServer) -> None:
    for i in range(8):
        assert isinstance(Peer(server, f"a{i}").hello("actor", ["solver", "verifier"]), Welcome)
    assert refused(Peer(server, "a8").hello("actor", ["solver", "verifier"]), "invalid")
    again = Peer(server, "a3")  # a registered actor re-registering is not a new one
    assert isinstance(again.hello("actor", ["solver", "verifier"]), Welcome)


def test_weight_digests_are_kept_for_live_versions_only(server: BrokerServer) -> None:
    st = server.state
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    for v in range(1, 40):
        st.versions["solver"] = v
        st.weights.plan("solver", v, "127.0.0.1:1", 0.0)
        st.weights.loaded("a", "solver", v, True, f"d{v}")
        for old in range(max(0, v - 10), v):  # late loads of old versions
            st.weights.loaded("a", "solver", old, True, "late")
    assert len(st.weights.loaded_digest) <= 3 and len(st.weights.sent_digest) <= 3


def test_huge_lists_and_texts_are_refused_with_short_replies_and_logs(
    server: BrokerServer, caplog: pytest.LogCaptureFixture
) -> None:
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    caplog.set_level(logging.WARNING, "drmas.broker")
    actor.send(LeaseReturn("a", list(range(2_000)), reason="x" * 1_100_000))  # > 1 MB: no decode
    reply = actor.next(20)
    assert refused(reply, "too_large") and len(reply.reason) < 600
    actor.send(Goodbye("a", list(range(100_000))))  # over the wire ceiling of 4,096 ids
    assert refused(actor.next(), "bad_frame")
    many = Peer(server, "m")
    reply = many.hello("actor", [f"model{i}" for i in range(1_000)])  # 64 models at most
    assert refused(reply, "bad_frame") and len(reply.reason) < 600
    assert max(len(r.getMessage()) for r in caplog.records) < 1000
    assert "a" in server.state.table.actors  # the refused Goodbye did not remove it


def test_an_internal_error_is_refused_counted_and_logged_once(
    server: BrokerServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)

    def broken(*_a: Any, **_k: Any) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(server.state, "lease", broken)
    caplog.set_level(logging.ERROR, "drmas.broker")
    for _ in range(3):
        assert refused(actor.ask(LeaseRequest("a", 1, {})), "internal")
    assert server.state.counters["refused/internal"] == 3
    assert sum("Traceback" in r.getMessage() for r in caplog.records) == 1
    assert isinstance(actor.ask(StatusRequest()), StatusReply)


def group(lease: Lease, token: int = 3) -> GroupResult:
    """A finished group for `lease` whose responses are `token` (the vocabulary is 64)."""
    steps = [Step(agent, agent, pack_ids([1, 2]), pack_ids([token]), pack_logprobs([-0.5]), 0,
                  True, "stop") for agent in ("solver", "verifier")]  # fmt: skip
    return pack_group("a", lease.lease_id, lease.group_id, [Episode(steps, 1.0)] * 2)


def test_a_group_failing_validation_is_refused_then_its_lease_handed_back(
    server: BrokerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = server.state
    actor = Peer(server, "a")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    leases = actor.ask(LeaseRequest("a", 2, {}))
    assert isinstance(leases, Leases) and len(leases.leases) == 2
    bad, good = leases.leases
    lookups: list[tuple[int, str]] = []
    owned = st.table.owned
    monkeypatch.setattr(st.table, "owned", lambda *a: lookups.append(a) or owned(*a))
    seen = st.table.actors["a"].last_seen
    assert refused(actor.ask(group(bad, token=999)), "invalid")  # outside the vocabulary
    assert lookups == [(bad.lease_id, "a")]  # the lease is looked up once per group
    assert st.table.actors["a"].last_seen == seen  # nothing changed before the refusal...
    c = st.counters  # ...then the lease was handed back, its task first in line again
    assert (c["refused/invalid"], c["groups_invalid"], c["leases_handed_back"]) == (1, 1, 1)
    assert bad.lease_id not in st.table.leases and c["groups_accepted"] == 0
    assert st.source.next_task().task_id == bad.task.task_id
    reply = actor.ask(group(good))
    assert isinstance(reply, Accepted) and reply.accepted and len(lookups) == 2
    late = actor.ask(group(bad))  # the handed-back lease: answered, not refused
    assert isinstance(late, Accepted) and not late.accepted and "not held" in late.reason
    assert c["late_results_refused"] == 1 and c["refused/invalid"] == 1
    seen = st.table.actors["a"].last_seen
    assert refused(actor.ask(LeaseRequest("a", 0, {})), "invalid")  # max_groups 1..1024
    assert st.table.actors["a"].last_seen == seen and c["leases_issued"] == 2
    assert lease_accounting(st)["balanced"] == 1


def test_a_weight_group_plan_names_only_registered_actors(server: BrokerServer) -> None:
    learner, actor = Peer(server, "L"), Peer(server, "a")
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    plan = learner.ask(PublishRequest("solver", 0, "127.0.0.1:1"))
    assert isinstance(plan, WeightGroupPlan) and plan.members == ["a"]
    assert isinstance(actor.next(), JoinWeightGroup)
    learner.send(PublishDone("solver", 0, 0.1, 10, digest="d"))
    actor.send(WeightsLoaded("a", "solver", 0, 0.1, digest="d"))
    assert actor.next(0.3) is None and learner.next(0.1) is None
    assert server.state.counters["weight_digest_match"] == 1


def test_an_actor_that_never_checks_in_is_dropped_after_three_publishes(
    server: BrokerServer,
) -> None:
    """A connection that registers as an actor and heartbeats but never joins a weight
    group: each PublishDone names it left out; the third in a row drops it (its next
    message is answered unknown_client). A left_out naming a non-member is refused."""
    learner, actor = Peer(server, "L"), Peer(server, "a")
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    plan = learner.ask(PublishRequest("solver", 0, "127.0.0.1:1"))
    assert isinstance(plan, WeightGroupPlan) and plan.members == ["a"]
    assert refused(learner.ask(PublishDone("solver", 0, 0.1, 0, left_out=["x"])), "invalid")
    st = server.state
    learner.send(PublishDone("solver", 0, 0.1, 0, left_out=["a"]))
    learner.next(0.2)
    st.versions["solver"] = 1
    plan = learner.ask(PublishRequest("solver", 1, "127.0.0.1:1"))
    assert isinstance(plan, WeightGroupPlan) and plan.members == []  # on probation
    for _ in range(2):  # re-publishes of v1 to it alone
        plan = learner.ask(PublishRequest("solver", 1, "127.0.0.1:1"))
        assert isinstance(plan, WeightGroupPlan) and plan.members == ["a"]
        learner.send(PublishDone("solver", 1, 0.1, 0, left_out=["a"]))
        learner.next(0.2)
    assert st.counters["weight_joins_missed"] == 3 and st.counters["actors_never_joined"] == 1
    assert "a" not in st.table.actors
    while isinstance(actor.next(0.2), JoinWeightGroup):  # the three joins it never took
        pass
    assert refused(actor.ask(LeaseRequest("a", 1, {})), "unknown_client")


def test_a_publish_done_names_as_broke_only_members_of_a_failed_publish(
    server: BrokerServer,
) -> None:
    """PublishDone.broke (members that checked in and never joined): refused when it names
    a non-member, a member twice or one left out, or comes with a publish that worked;
    else counted against the named member only (as two missed joins)."""
    learner, actor, other = Peer(server, "L"), Peer(server, "a"), Peer(server, "b")
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    for peer in (actor, other):
        assert isinstance(peer.hello("actor", ["solver", "verifier"]), Welcome)
    plan = learner.ask(PublishRequest("solver", 0, "127.0.0.1:1"))
    assert isinstance(plan, WeightGroupPlan) and plan.members == ["a", "b"]
    for bad in (
        PublishDone("solver", 0, 0.1, 0, False, "x", broke=["x"]),
        PublishDone("solver", 0, 0.1, 0, False, "x", broke=["a", "a"]),
        PublishDone("solver", 0, 0.1, 0, False, "x", left_out=["a"], broke=["a"]),
        PublishDone("solver", 0, 0.1, 0, True, broke=["a"]),
    ):
        assert refused(learner.ask(bad), "invalid")
    learner.send(PublishDone("solver", 0, 10.0, 0, False, "rendezvous", broke=["b"]))
    learner.next(0.2)
    weights = server.state.weights
    assert weights.missed_joins == {"b": 2} and not weights.suspects.get("solver")


def wait_for(cap: ConnectionCap, done: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Handle the cap's monitor events as they arrive until `done()` (False at the deadline)."""
    deadline = time.monotonic() + timeout
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if cap.monitor.poll(max(1, int(left * 1000))):  # wakes on the next event
            cap.poll()
    return True


def hung_up(socks: list[socket.socket], want: int, timeout: float = 10.0) -> int:
    """How many of `socks` saw the broker hang up: read them as data arrives until `want`
    did (or the deadline), then count those whose hang-up has already arrived too."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            wait = max(left, 0.0) if closed < want else 0.0  # then one last look, no wait
            ready = sel.select(wait)
            for key, _ in ready:
                try:
                    data = key.fileobj.recv(4096)  # type: ignore[union-attr]
                except ConnectionResetError:
                    data = b""
                if not data:  # end of stream: the broker closed it
                    closed += 1
                    sel.unregister(key.fileobj)
            if not ready and (closed >= want or left <= 0):
                return closed
    finally:
        sel.close()


def test_connections_beyond_the_per_host_cap_are_closed(tmp_path: Path) -> None:
    """3,000 idle connections used to stay open (+80 MB); now a host holds at most
    broker.max_connections_per_host and the rest are closed as they arrive."""
    with broker_server(tmp_path, "broker.max_connections_per_host=20") as srv:
        cap = srv.connections
        host, port = srv.address.removeprefix("tcp://").rsplit(":", 1)
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(60)]
        try:
            assert wait_for(cap, lambda: cap.refused >= 40)
            assert cap.refused == 40 and cap.per_host["loopback"] == 20
            assert hung_up(idle, 40) == 40  # the refused ones see the broker hang up, no others
            for s in idle[:10]:  # room again once some leave
                s.close()
            assert wait_for(cap, lambda: cap.per_host["loopback"] <= 10)
            assert cap.per_host["loopback"] == 10
            peer = Peer(srv, "ops")
            assert isinstance(peer.ask(StatusRequest()), StatusReply)
        finally:
            for s in idle:
                s.close()


def test_a_hello_beyond_the_connection_cap_is_refused_not_left_to_time_out(
    tmp_path: Path,
) -> None:
    """Issue #36, item 9: while one host holds the connection cap, a new client's Hello got
    no answer at all. The broker can say nothing on a connection it shuts at once, so the
    client counts the closes and refuses itself, naming the caps."""
    import threading

    from drmas.transports.channel import BrokerClient, BrokerRefused

    with broker_server(tmp_path, "broker.max_connections_per_host=2") as srv:
        stop = threading.Event()

        def pump() -> None:  # as the broker loop (serve) reads and applies its caps
            while not stop.is_set():
                if srv.sock.poll(20):
                    srv.connections.poll()
                    srv.drain()
                srv.connections.poll()

        loop = threading.Thread(target=pump, daemon=True)
        loop.start()
        host, port = srv.address.removeprefix("tcp://").rsplit(":", 1)
        holders = [socket.create_connection((host, int(port)), timeout=5) for _ in range(2)]
        try:
            deadline = time.monotonic() + 30
            while srv.connections.per_host["loopback"] < 2 and time.monotonic() < deadline:
                time.sleep(0.01)  # the pump counts them
            assert srv.connections.per_host["loopback"] == 2
            late = BrokerClient(srv.address, "late")
            with pytest.raises(BrokerRefused) as err:
                late.hello("client", [], timeout_s=120)
            late.close()
            assert err.value.code == "closed" and "max_connections_per_host" in str(err.value)
            holders.pop().close()  # room again: the next one is welcomed
            again = BrokerClient(srv.address, "again")
            assert isinstance(again.hello("client", [], timeout_s=120), Welcome)
            again.close()
        finally:
            stop.set()
            loop.join(10)
            for s in holders:
                s.close()
