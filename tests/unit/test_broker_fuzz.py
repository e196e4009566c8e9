"""Property-based fuzzing of the broker's message handling: random sequences of valid and
invalid messages, from random identities in random roles, through the same `handle` the
broker loop calls for every frame. Whatever the sequence:
- nothing raises, and nothing reaches the last-resort handler (`refused/internal` = 0):
  every refusal is a foreseen one;
- every refusal is counted and answered (ErrorReplies sent = refused/* counters);
- lease accounting stays balanced;
- state stays bounded (registrations, digests, pending metrics, validation queue).
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
IDS = ["a1", "a2", "L0", "L1", "V0", "ops"]
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
    kind = draw(st.sampled_from([*range(14), 14, 14, 14, 15, 15, 15, 15, 16, 16, 16, 17, 17, 17]))
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
    return cid, msg


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64}))
    return folder


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=st.lists(action(), min_size=15, max_size=60))
def test_any_message_sequence_keeps_the_broker_alive_counted_and_bounded(
    model_dir: Path, actions: list[tuple[str, Any]]
) -> None:
    cfg = load_config(
        [f"models.{m}.path={model_dir}" for m in MODELS]
        + ["val.every=2", "val.num_tasks=1", "val.n=2", "val.k=2", "train.steps=4",
           "group_size=2", "batch_groups=1", "algorithm.max_staleness=1"]
    )  # fmt: skip
    server = BrokerServer(cfg, None)
    sent: list[tuple[str, Any]] = []
    server.connections.close()
    server.sock.close(linger=0)  # replies are recorded instead of sent
    server.sock = Recorder(lambda f: sent.append(
        (f[0].decode() if isinstance(f[0], bytes) else f[0], decode_from_broker(f[1]))))  # fmt: skip
    leases: dict[str, list[Any]] = {}
    seen = 0
    registered = [  # everyone says Hello first, so the random part reaches every handler
        ("a1", Hello("actor", "a1", PROTOCOL_VERSION, MODELS)),
        ("a2", Hello("actor", "a2", PROTOCOL_VERSION, MODELS)),
        ("L0", Hello("learner", "L0", PROTOCOL_VERSION, ["solver"])),
        ("V0", Hello("learner", "V0", PROTOCOL_VERSION, ["verifier"])),
        ("ops", Hello("client", "ops", PROTOCOL_VERSION)),
    ]
    try:
        for cid, msg in [*registered, *actions]:
            if isinstance(msg, tuple) and msg[0] == "result":
                held = leases.get(cid) or []
                if not held:
                    continue
                lease = held.pop(msg[1] % len(held))
                version = max(0, min(msg[2], server.state.versions["solver"]))
                episodes = [Episode([step("solver", version, msg[3]), step("verifier", version, True)],
                                    1.0) for _ in range(lease.group_size)]  # fmt: skip
                payload = encode(pack_group(cid, lease.lease_id, lease.group_id, episodes))
            elif isinstance(msg, tuple) and msg[0] == "lease":
                versions = {m: server.state.versions[m] for m in MODELS}
                payload = encode(LeaseRequest(cid, msg[1], versions))
            elif isinstance(msg, tuple) and msg[0] == "learner":
                model = msg[1] if msg[1] in MODELS else "solver"
                cid = "L0" if model == "solver" else "V0"
                v = server.state.versions[model]
                server.handle(
                    [Frame(cid.encode()), Frame(encode(BatchRequest(cid, model, 0, 1, v)))]
                )
                if isinstance(sent[-1][1], BatchShard):  # trained: report, publish, done
                    for m in (StepReport(model, v + 1, {}), PublishRequest(model, v + 1, "h:1"),
                              PublishDone(model, v + 1, 0.1, 10, True, "", "d")):  # fmt: skip
                        server.handle([Frame(cid.encode()), Frame(encode(m))])
                continue
            else:
                payload = msg if isinstance(msg, bytes) else encode(msg)
            server.handle([Frame(cid.encode()), Frame(payload)])
            for to, reply in sent[seen:]:
                if isinstance(reply, Leases):
                    leases.setdefault(to, []).extend(reply.leases)
            seen = len(sent)
            st_ = server.state
            counters = st_.counters
            assert counters["refused/internal"] == 0, counters
            refusals = sum(v for k, v in counters.items() if k.startswith("refused/"))
            assert refusals == sum(isinstance(r, ErrorReply) for _, r in sent)
            assert lease_accounting(st_)["balanced"] == 1
            assert len(st_.learners) <= len(MODELS) * 3
            assert len(st_.table.actors) <= len(IDS)
            assert len(st_.weights.loaded_digest) <= 3 * len(MODELS)
            assert len(st_.metrics.pending) <= cfg.train.steps + 2
            assert len(st_.validation.queue) <= cfg.val.num_tasks * (cfg.train.steps // 2 + 1)
            assert all(0 <= v <= cfg.train.steps for v in st_.versions.values())
    finally:
        server.ctx.term()
    time.sleep(0)
