"""Property-based fuzzing of the broker's message handling: random sequences of valid and
invalid messages, from random identities in random roles, through the same `handle` the
broker loop calls for every frame. Whatever the sequence:
- nothing raises, and nothing reaches the last-resort handler (`refused/internal` = 0):
  every refusal is a foreseen one;
- every refusal is counted and answered (ErrorReplies sent = refused/* counters);
- lease accounting stays balanced;
- state stays bounded (registrations, digests, pending metrics, validation queue);
- a learner seat has one holder: fresh ids claiming a held (model, rank) are refused, rank
  1 asking ahead never moves a version, and a version the model moved past is served only
  while its batch is still cut (issue #25's takeover, rank-1 and older-version sequences);
- trained and lost groups are accounted for exactly: a model's trained groups are those of
  the batches sent to its learner for versions it has since reported, no batch is cut
  twice for a version, and every accepted group is trained, buffered, in a cut batch, or
  counted as dropped (stale, or after the last batch), once.
Bounded to about 20 s (hypothesis settings below)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drmas.broker.server import BrokerServer
from drmas.broker.status import lease_accounting
from drmas.config import load_config
from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode, pack_ids, pack_logprobs
from drmas.protocol.messages import (
    BatchRequest,
    BatchShard,
    Episode,
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    LeaseRequest,
    LeaseReturn,
    Leases,
    PublishDone,
    PublishRequest,
    StatusRequest,
    Step,
    StepReport,
    WeightsLoaded,
    pack_group,
)
from tests.fixtures.router import Recorder

MODELS = ["solver", "verifier"]
IDS = ["a1", "a2", "L0", "L1", "V0", "ops", "X0", "X1"]
SEATS = {"L0": ("solver", 0, 2), "L1": ("solver", 1, 2), "V0": ("verifier", 0, 1)}
"""The honest learner ranks: client id -> (model, rank, world size); X0, X1 claim seats."""
RANK0 = {"solver": "L0", "verifier": "V0"}
NAMES = [*MODELS, "nope", ""]
VERSIONS = st.one_of(st.integers(-2, 5), st.sampled_from([10**6, 2**62]))


class Frame:
    """What `BrokerServer.handle` reads of a zmq.Frame."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


def step(agent: str, version: int, vocab_ok: bool) -> Step:
    return Step(agent, agent, pack_ids([1, 2]), pack_ids([3 if vocab_ok else 999]),
                pack_logprobs([-0.5]), version, True, "stop")  # fmt: skip


@st.composite
def action(draw: st.DrawFn) -> tuple[str, Any]:
    """(identity, message or raw bytes or ('result', ...) for a held lease)."""
    cid = draw(st.sampled_from(IDS))
    model, version = draw(st.sampled_from(NAMES)), draw(VERSIONS)
    rank, world = draw(st.integers(-1, 3)), draw(st.integers(0, 3))
    # about half the actions are what honest clients do (leases, results, learner steps)
    kind = draw(st.sampled_from([*range(14), 14, 14, 14, 15, 15, 15, 15, 16, 16, 16, 17, 17, 17,
                                 18, 19, 20, 21, 22]))  # fmt: skip
    if kind >= 15:
        cid = draw(st.sampled_from(["a1", "a2"]))
    msg: Any
    if kind == 0:
        role = draw(st.sampled_from(["actor", "learner", "client"]))
        models = MODELS if role == "actor" else [model] if role == "learner" else []
        if draw(st.booleans()):
            models = draw(st.lists(st.sampled_from(NAMES), max_size=4))
        msg = Hello(role, cid, PROTOCOL_VERSION, models, rank, world)  # type: ignore[arg-type]
    elif kind == 1:
        msg = Heartbeat(cid, {model: version})
    elif kind in (2, 15):  # 15: as an honest actor asks
        msg = LeaseRequest(cid, draw(st.integers(-1, 5)), {model: version} if version > 0 else {})
        if kind == 15:
            msg = ("lease", draw(st.integers(1, 3)))
    elif kind in (3, 16, 17):  # a result for a held lease (mostly valid)
        msg = ("result", draw(st.integers(0, 10)), version, kind != 3 or draw(st.booleans()))
    elif kind == 4:
        msg = BatchRequest(cid, model, rank, world, version)
    elif kind == 5:
        msg = StepReport(model, version, {f"m{i}": 0.5 for i in range(draw(st.integers(0, 3)))})
    elif kind == 6:
        msg = PublishRequest(model, version, "127.0.0.1:1")
    elif kind == 7:
        msg = PublishDone(model, version, 0.1, 10, draw(st.booleans()), "", "d")
    elif kind == 8:
        msg = WeightsLoaded(cid, model, version, 0.1, draw(st.booleans()), "", "d")
    elif kind == 9:
        msg = LeaseReturn(cid, draw(st.lists(st.integers(-1, 12), max_size=5)), "r")
    elif kind == 10:
        msg = Goodbye(cid, draw(st.lists(st.integers(-1, 12), max_size=5)))
    elif kind == 11:
        msg = StatusRequest()
    elif kind == 12:
        msg = draw(st.binary(max_size=64))  # garbage
    elif kind == 13:
        msg = Heartbeat(draw(st.sampled_from(IDS)), {})  # maybe someone else's id
    elif kind == 14:  # the honest learner loop, so valid steps and publishes happen too
        msg = ("learner", model)
    elif kind == 18:  # a fresh id claims a learner seat, as the issue's intruder did
        cid = draw(st.sampled_from(["X0", "X1"]))
        seat = draw(st.sampled_from(sorted(SEATS.values())))
        msg = Hello("learner", cid, PROTOCOL_VERSION, [seat[0]], seat[1], seat[2])
    elif kind == 19:  # rank 1 asks ahead of (or at) the model's version
        msg = ("ask", "L1", draw(st.integers(0, 2)))
    elif kind == 20:  # rank 0 asks for a version its model moved past, or one ahead
        msg = ("ask", draw(st.sampled_from(["L0", "V0"])), draw(st.sampled_from([-2, -1, 1])))
    elif kind == 21:  # an honest rank says Goodbye
        msg = ("goodbye", draw(st.sampled_from(sorted(SEATS))))
    elif kind == 22:  # an honest rank says Hello again (a restart under its own id)
        msg = ("hello", draw(st.sampled_from(sorted(SEATS))))
    return cid, msg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64}))
    return folder


class Run:
    """The broker under test, every reply it sent, and what a learner was actually sent."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        self.sent: list[tuple[str, Any]] = []
        self.seen = 0
        self.leases: dict[str, list[Any]] = {}
        # model -> version -> group ids of the batch sent to its learner for that version
        self.batches: dict[str, dict[int, set[int]]] = {m: {} for m in MODELS}
        self.reported = dict.fromkeys(MODELS, 0)  # the last step report each model accepted
        server.connections.close()
        server.sock.close(linger=0)  # replies are recorded instead of sent
        server.sock = Recorder(lambda f: self.sent.append(
            (f[0].decode() if isinstance(f[0], bytes) else f[0], decode_from_broker(f[1]))))  # fmt: skip

    def deliver(self, cid: str, msg: Any) -> list[Any]:
        """One frame from `cid` through `handle`, as the loop passes it; its replies."""
        payload = msg if isinstance(msg, bytes) else encode(msg)
        self.server.handle([Frame(cid.encode()), Frame(payload)])
        replies = [reply for _, reply in self.sent[self.seen :]]
        for to, reply in self.sent[self.seen :]:
            if isinstance(reply, Leases):
                self.leases.setdefault(to, []).extend(reply.leases)
            if isinstance(reply, BatchShard):
                self.record_batch(reply)
        self.seen = len(self.sent)
        if isinstance(msg, StepReport) and not any(isinstance(r, ErrorReply) for r in replies):
            self.reported[msg.model] = msg.version
        return replies

    def record_batch(self, shard: BatchShard) -> None:
        """The groups of the batch a shard comes from; a version's batch is cut once."""
        groups = {
            p.group_id for p in self.server.state.buffers[shard.model].cut[shard.version].slices
        }
        before = self.batches[shard.model].setdefault(shard.version, groups)
        assert before == groups, f"{shard.model} v{shard.version} was cut twice"

    def honest_step(self, model: str) -> None:
        """Every rank of `model`'s group asks for its shard; rank 0 then reports the step and
        publishes, as drmas/learners/main.py does."""
        v = self.server.state.versions[model]
        ranks = [cid for cid, seat in SEATS.items() if seat[0] == model]
        for cid in ranks:
            _, rank, world = SEATS[cid]
            replies = self.deliver(cid, BatchRequest(cid, model, rank, world, v))
            if not replies or not isinstance(replies[-1], BatchShard):
                return
        rank0 = RANK0[model]
        for m in (StepReport(model, v + 1, {}), PublishRequest(model, v + 1, "h:1"),
                  PublishDone(model, v + 1, 0.1, 10, True, "", "d")):  # fmt: skip
            self.deliver(rank0, m)

    def check(self, cfg: Any) -> None:
        st_ = self.server.state
        counters = st_.counters
        assert counters["refused/internal"] == 0, counters
        refusals = sum(v for k, v in counters.items() if k.startswith("refused/"))
        assert refusals == sum(isinstance(r, ErrorReply) for _, r in self.sent)
        assert lease_accounting(st_)["balanced"] == 1
        seats = [(r.model, r.rank) for r in st_.learners.values()]
        assert len(seats) == len(set(seats)), st_.learners  # one holder per seat
        assert len(st_.table.actors) <= len(IDS)
        assert len(st_.weights.loaded_digest) <= 3 * len(MODELS)
        assert len(st_.metrics.pending) <= cfg.train.steps + 2
        assert len(st_.validation.queue) <= cfg.val.num_tasks * (cfg.train.steps // 2 + 1)
        assert all(0 <= v <= cfg.train.steps for v in st_.versions.values())
        self.check_accounting()

    def check_accounting(self) -> None:
        """Trained = the batches sent for versions since reported, each group once; every
        other accepted group is buffered, in a cut batch, or counted as dropped."""
        st_ = self.server.state
        assert st_.counters["groups_trained_twice"] == 0
        lost = 0
        for m in MODELS:
            sent = self.batches[m]
            done = [sent[v] for v in sorted(sent) if v < self.reported[m]]
            assert sum(map(len, done)) == len(set().union(*done)), sent  # no group twice
            trained = st_.trained_groups[m]
            assert trained == set().union(*done), (m, trained, sent, self.reported)
            buf = st_.buffers[m]
            buffered = [p.group_id for p in buf.slices]
            cut = [p.group_id for b in buf.cut.values() for p in b.slices]
            held = [*trained, *buffered, *cut]
            assert len(held) == len(set(held)), (m, trained, buffered, cut)
            assert set(held) <= st_.accepted_groups
            lost += len(st_.accepted_groups - set(held))
            lost -= st_.counters[f"slices_after_last_batch/{m}"]
        assert lost == st_.counters["dropped_stale_groups"]


def replay(model_dir: Path, actions: list[tuple[str, Any]]) -> Run:
    """Every client says Hello, then `actions` are played, each followed by `Run.check`."""
    cfg = load_config(
        [f"models.{m}.path={model_dir}" for m in MODELS]
        + ["val.every=2", "val.num_tasks=1", "val.n=2", "val.k=2", "train.steps=4",
           "group_size=2", "batch_groups=1", "algorithm.max_staleness=1"]
    )  # fmt: skip
    server = BrokerServer(cfg, None)
    run = Run(server)
    registered = [  # everyone says Hello first, so the random part reaches every handler
        ("a1", Hello("actor", "a1", PROTOCOL_VERSION, MODELS)),
        ("a2", Hello("actor", "a2", PROTOCOL_VERSION, MODELS)),
        *[(cid, Hello("learner", cid, PROTOCOL_VERSION, [m], r, w))
          for cid, (m, r, w) in SEATS.items()],
        ("ops", Hello("client", "ops", PROTOCOL_VERSION)),
    ]  # fmt: skip
    try:
        for cid, msg in [*registered, *actions]:
            play(run, cid, msg)
            run.check(cfg)
    finally:
        server.ctx.term()
    return run


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(action(), min_size=15, max_size=60))
def test_any_message_sequence_keeps_the_broker_alive_counted_and_bounded(
    model_dir: Path, actions: list[tuple[str, Any]]
) -> None:
    replay(model_dir, actions)
    time.sleep(0)


def test_the_issue_sequences_are_refused_and_the_accounting_stays_exact(model_dir: Path) -> None:
    """Issue #25, replayed: an intruder claims solver rank 0 and 1, rank 1 asks ahead, rank 0
    asks for the version it has trained (which cut a new batch the next report counted as
    trained: 6 groups trained, 4 sent)."""
    groups = [("a1", ("lease", 2)), ("a1", ("result", 0, 0, True)), ("a1", ("result", 0, 0, True))]
    run = replay(model_dir, [
        ("X0", Hello("learner", "X0", PROTOCOL_VERSION, ["solver"], 0, 2)),
        ("X1", Hello("learner", "X1", PROTOCOL_VERSION, ["solver"], 1, 2)),
        *groups, ("L0", ("learner", "solver")), *groups,
        *[("L1", ("ask", "L1", 1))] * 8,
        ("L0", ("ask", "L0", -1)),
        ("L0", ("learner", "solver")), ("L0", ("learner", "solver")),
    ])  # fmt: skip
    st_ = run.server.state
    assert sorted(st_.learners) == ["L0", "L1", "V0"]
    assert st_.versions["solver"] == run.reported["solver"] == 2
    sent = run.batches["solver"]
    assert sorted(sent) == [0, 1] and st_.trained_groups["solver"] == sent[0] | sent[1]
    assert len(st_.trained_groups["solver"]) == 2  # batch_groups=1: one group per step
    assert st_.counters["refused/forbidden"] == 2 and st_.counters["refused/invalid"] == 9


def holder(run: Run, model: str, rank: int, cid: str) -> str:
    """The id other than `cid` holding the (model, rank) seat ("" = free)."""
    seats = run.server.state.learners.items()
    return next((c for c, r in seats if (r.model, r.rank) == (model, rank) and c != cid), "")


def play(run: Run, cid: str, msg: Any) -> None:
    """One action of the sequence; the tuples are the honest or scripted ones."""
    state = run.server.state
    if isinstance(msg, tuple) and msg[0] in ("goodbye", "hello"):
        cid = msg[1]
        model, rank, world = SEATS[cid]
        msg = Goodbye(cid) if msg[0] == "goodbye" else Hello(
            "learner", cid, PROTOCOL_VERSION, [model], rank, world)  # fmt: skip
    if not isinstance(msg, tuple):
        claim = isinstance(msg, Hello) and msg.role == "learner" and len(msg.models) == 1
        taken = claim and holder(run, msg.models[0], msg.rank, cid)
        replies = run.deliver(cid, msg)
        if taken:  # a held seat: refused, never swapped in
            assert isinstance(replies[-1], ErrorReply) and replies[-1].code in (
                "forbidden", "invalid"), (msg, taken, replies)  # fmt: skip
            assert holder(run, msg.models[0], msg.rank, cid) == taken
    elif msg[0] == "result":
        held = run.leases.get(cid) or []
        if not held:
            return
        lease = held.pop(msg[1] % len(held))
        version = max(0, min(msg[2], state.versions["solver"]))
        episodes = [Episode([step("solver", version, msg[3]), step("verifier", version, True)],
                            1.0) for _ in range(lease.group_size)]  # fmt: skip
        run.deliver(cid, pack_group(cid, lease.lease_id, lease.group_id, episodes))
    elif msg[0] == "lease":
        run.deliver(cid, LeaseRequest(cid, msg[1], {m: state.versions[m] for m in MODELS}))
    elif msg[0] == "learner":
        run.honest_step(msg[1] if msg[1] in MODELS else "solver")
    elif msg[0] == "ask":  # a rank asks for its model's version plus an offset
        _, who, offset = msg
        model, rank, world = SEATS[who]
        version = state.versions[model] + offset
        replies = run.deliver(who, BatchRequest(who, model, rank, world, version))
        moved_past = offset < 0 and version not in state.buffers[model].cut
        if who in state.learners and (moved_past or (rank and offset > 0)):
            assert replies and isinstance(replies[-1], ErrorReply), (msg, replies)
