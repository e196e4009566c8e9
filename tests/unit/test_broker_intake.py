"""The broker's intake (drmas/broker/intake.py) and connection caps
(drmas/broker/connections.py): messages bounded on their raw frames before decoding,
misbehaving peers dropped and banned, connections capped per host (loopback aliases are
one host), in all and per CURVE key. Real sockets on loopback where the path matters; a
fake socket and clock where exact counts do."""

from __future__ import annotations

import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import drmas.broker.intake as intake_mod
import drmas.broker.server as server_mod
from drmas.broker.connections import OBSERVER_KEY_CONNECTIONS, ConnectionCap, host_of
from drmas.broker.intake import STATUS_BURST, STRIKES, FrameLimits, Intake, is_group_result
from drmas.broker.limits import group_bytes
from drmas.broker.server import BrokerServer
from drmas.broker.wire_watch import SLACK
from drmas.protocol import encode
from drmas.protocol.messages import (
    GroupResult,
    LeaseReturn,
    StatusReply,
    StatusRequest,
    Welcome,
    pack_group,
)
from tests.fixtures.broker_server import broker_server
from tests.unit.test_broker_gate import Peer, hung_up, refused, wait_for


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with broker_server(tmp_path) as srv:
        yield srv


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the payloads the broker decoded (its decoder, wrapped)."""
    seen: list[int] = []
    real = server_mod.decode_to_broker

    def counting(payload: Any) -> Any:
        seen.append(len(payload))
        return real(payload)

    monkeypatch.setattr(server_mod, "decode_to_broker", counting)
    return seen


# ----------------------------------------------------------------- parts
def test_extra_parts_are_discarded_counted_and_a_repeat_drops_the_peer(
    server: BrokerServer,
) -> None:
    """10,000 empty parts before any Hello (20 KB, within what the unread-bytes watch lets
    a connection send before Hello; larger ones are shut before they arrive:
    tests/unit/test_wire_watch.py). Refused as too_many_parts (worth STRIKES / 2 strikes);
    the second such message drops the peer, unanswered, and what it sends while banned is
    discarded unread."""
    evil, ops = Peer(server, "evil"), Peer(server, "ops")
    parts = [b""] * 10_000
    evil.sock.send_multipart([*parts, b"end"])
    assert refused(evil.next(), "too_many_parts")
    evil.sock.send_multipart([*parts, b"end"])
    assert evil.next(1.0) is None  # dropped: not answered
    c = server.state.counters
    assert c["refused/too_many_parts"] == 2 and c["dropped/too_many_parts"] == 1
    assert isinstance(ops.ask(StatusRequest()), StatusReply)  # others still served
    assert b"evil" in server.intake.banned


# ------------------------------------------------------------------ sizes
def test_before_hello_only_small_frames_are_decoded(
    server: BrokerServer, decodes: list[int]
) -> None:
    stranger = Peer(server, "s")
    big = encode(LeaseReturn("s", [], "x" * 4000)) * 5  # ~20 KB, over max_hello_bytes=16 KB
    reply = stranger.ask(big)
    assert refused(reply, "too_large") and "16384" in reply.reason
    assert decodes == []  # refused on its length, never decoded
    assert isinstance(stranger.ask(StatusRequest()), StatusReply)
    assert decodes == [len(encode(StatusRequest()))]


def test_after_hello_only_an_actors_group_result_may_be_large(
    server: BrokerServer, decodes: list[int]
) -> None:
    from tests.unit.test_broker_state import result

    actor, learner = Peer(server, "a"), Peer(server, "L")
    assert isinstance(actor.hello("actor", ["solver", "verifier"]), Welcome)
    assert isinstance(learner.hello("learner", ["solver"]), Welcome)
    decodes.clear()
    control = server.cfg.broker.max_control_bytes
    padded = encode(LeaseReturn("a", [], "x" * 4000)) + b"\x00" * control  # > 1 MB
    assert refused(actor.ask(padded), "too_large")
    lease = server.state.lease("a", 1, {}, time.monotonic()).leases[0]
    group = result(lease)
    filler = b"\x01\x00\x00\x00" * (control // 4)  # a group over 1 MB, under the group limit
    big = GroupResult(group.client_id, group.lease_id, group.group_id, group.episodes,
                      memoryview(bytes(group.prompt_ids) + filler), group.response_ids,
                      group.logprobs)  # fmt: skip
    frame = encode(big)
    assert control < len(frame) < server.intake.limits.group
    assert refused(actor.ask(frame), "invalid")  # decoded and checked: its headers disagree
    assert refused(learner.ask(frame), "too_large")  # a learner sends no groups
    assert decodes == [len(frame)]


def test_the_socket_ceiling_is_the_largest_group_the_run_can_make(tmp_path: Path) -> None:
    with broker_server(tmp_path, "sampling.max_new_tokens=100", "val.n=4") as srv:
        limits = srv.gate.limits
        steps = limits.max_steps_per_episode
        # by hand: 4 bytes a token (prompt, response ids, log-probs), names at 128 chars,
        # 64 metrics a episode, 4 episodes (val.n > group_size=2), 64 KB of margin
        per_step = 4 * (32_768 + 2 * 100) + 4 * 128
        per_episode = steps * per_step + 64 * (128 + 16) + 256
        assert group_bytes(srv.cfg, limits) == 4 * per_episode + 65_536
        assert srv.sock.getsockopt(zmq.MAXMSGSIZE) == srv.intake.limits.group
        assert srv.intake.limits.group == 4 * per_episode + 65_536


def test_is_group_result_reads_the_leading_tag() -> None:
    group = encode(pack_group("a", 1, 2, []))
    assert is_group_result(group) and not is_group_result(encode(StatusRequest()))
    assert not is_group_result(b"") and not is_group_result(b"\x91\xa4type")


# ----------------------------------------------------- budget, rate, bans
class FakeSock:
    """Frames handed out as a ROUTER would: [identity, payload] with `more` set."""

    def __init__(self) -> None:
        self.queue: list[FakeFrame] = []

    def push(self, identity: bytes, *payload: bytes) -> None:
        parts = [identity, *payload]
        self.queue += [FakeFrame(p, i < len(parts) - 1) for i, p in enumerate(parts)]

    def recv(self, flags: int = 0, copy: bool = True) -> FakeFrame:
        if not self.queue:
            raise zmq.Again()
        return self.queue.pop(0)


class FakeFrame:
    def __init__(self, data: bytes, more: bool) -> None:
        self.bytes, self.buffer, self.more = data, memoryview(data), more

    def __len__(self) -> int:
        return len(self.bytes)

    def get(self, option: Any) -> Any:
        return 7 if option == zmq.SRCFD else None


class FakeCap:
    def __init__(self) -> None:
        self.shut_fds: list[int] = []

    def admit_key(self, fd: int, frame: Any) -> bool:
        return True

    def shut(self, fd: int) -> None:
        self.shut_fds.append(fd)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [1000.0]

    class Time:
        @staticmethod
        def monotonic() -> float:
            return now[0]

    monkeypatch.setattr(intake_mod, "time", Time)
    return now


def make_intake(
    roles: dict[str, str] | None = None, bytes_per_s: int = 1000
) -> tuple[Intake, FakeSock, FakeCap, Counter[str]]:
    sock, cap, counters = FakeSock(), FakeCap(), Counter[str]()
    limits = FrameLimits(hello=100, control=1000, group=10_000, bytes_per_s=bytes_per_s)
    by_identity = {k.encode(): v for k, v in (roles or {}).items()}  # connection -> role
    intake = Intake(sock, limits, cap, counters, by_identity.get)
    return intake, sock, cap, counters


def test_the_byte_budget_refills_at_its_rate(clock: list[float]) -> None:
    """An actor's control frames (limit 1000 bytes, 1000 bytes/s): the budget holds twice
    the largest frame (2000); 900 + 900 pass, the third 900 is over it; half a second
    later 500 bytes more are there."""
    intake, sock, _cap, counters = make_intake({"a": "actor"})
    for _ in range(3):
        sock.push(b"a", b"x" * 900)
    assert isinstance(intake.read(), list) and isinstance(intake.read(), list)
    refusal = intake.read()
    assert not isinstance(refusal, list) and refusal.code == "over_budget"
    clock[0] += 0.5  # 200 left + 500 refilled = 700: 600 passes, 200 does not
    sock.push(b"a", b"x" * 600)
    sock.push(b"a", b"x" * 200)
    assert isinstance(intake.read(), list)
    assert not isinstance(intake.read(), list)
    assert counters["refused/over_budget"] == 2


def test_unread_allowance_follows_the_senders_largest_messages() -> None:
    """What libzmq may hold unread for a connection (drmas/broker/wire_watch.py), with
    hello 100, control 1,000 and group 10,000 bytes: twice a Hello before any message
    named the sender or from an observer, twice a control message from a learner, and
    from an actor holding 3 leases two control messages and 3 + 1 groups."""
    sock, cap, counters = FakeSock(), FakeCap(), Counter[str]()
    limits = FrameLimits(hello=100, control=1000, group=10_000, bytes_per_s=1000)
    roles, leases = {b"a": "actor", b"L": "learner"}, {b"a": 3}
    intake = Intake(sock, limits, cap, counters, roles.get, lambda i: leases.get(i, 0))
    assert intake.allowance(b"") == SLACK + 200
    assert intake.allowance(b"observer") == SLACK + 200
    assert intake.allowance(b"L") == SLACK + 2000
    assert intake.allowance(b"a") == SLACK + 2000 + 4 * 10_000
    leases[b"a"] = 0
    assert intake.allowance(b"a") == SLACK + 2000 + 10_000


def test_status_requests_are_rate_limited_then_the_peer_is_dropped_and_banned(
    clock: list[float],
) -> None:
    intake, sock, cap, counters = make_intake()
    status = encode(StatusRequest())
    answered = 0
    for _ in range(STATUS_BURST + STRIKES):
        sock.push(b"o", status)
        assert isinstance(intake.read(), list)
        answered += intake.allow_status(b"o") is None
    assert answered == STATUS_BURST  # then each is a strike; the STRIKES-th drops it
    assert counters["refused/rate_limited"] == STRIKES and counters["dropped/rate_limited"] == 1
    assert cap.shut_fds == [7]
    sock.push(b"o", status)  # banned for BAN_S[0] = 1 s: discarded unread, shut again
    refusal = intake.read()
    assert not isinstance(refusal, list) and refusal.code == "banned" and not refusal.answer
    assert cap.shut_fds == [7, 7]
    clock[0] += 1.01  # the ban is over; a second drop bans for twice as long
    sock.push(b"o", status)
    assert isinstance(intake.read(), list)
    intake.drop(b"o", "not_reading")
    until, length = intake.banned[b"o"]
    assert length == 2.0 and until == pytest.approx(clock[0] + 2.0)


def test_frames_of_a_banned_identity_are_never_decoded(
    server: BrokerServer, decodes: list[int]
) -> None:
    server.intake.drop(b"x", "test")
    peer = Peer(server, "x")
    assert peer.ask(StatusRequest(), 0.5) is None
    assert decodes == [] and server.state.counters["refused/banned"] >= 1


def test_a_peer_that_does_not_read_its_replies_is_dropped(server: BrokerServer) -> None:
    """A client whose libzmq takes one reply and whose kernel buffer is 4 KB: the broker's
    1,000 queued replies (REPLY_QUEUE) fill and it is dropped instead of buffered for."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"deaf")
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.address)
    ask = encode(LeaseReturn("deaf", []))  # before Hello: an unknown_client reply each time
    try:
        deadline = time.monotonic() + 60
        while not server.state.counters["dropped/not_reading"] and time.monotonic() < deadline:
            for _ in range(500):
                try:
                    sock.send(ask, zmq.NOBLOCK)
                except zmq.Again:  # its own send queue is full: let the broker read
                    break
            if server.sock.poll(10):
                server.drain(1000)
        assert server.state.counters["dropped/not_reading"] >= 1
    finally:
        sock.close(linger=0)
    assert isinstance(Peer(server, "ops").ask(StatusRequest()), StatusReply)


# ----------------------------------------------------------- connections
def test_host_of_counts_loopback_aliases_and_mapped_addresses_as_one_host() -> None:
    assert {host_of(a) for a in ("127.0.0.1", "127.0.0.13", "::1", "::ffff:127.0.0.2")} == {
        "loopback"
    }
    assert host_of("::ffff:10.1.2.3") == "10.1.2.3" and host_of("10.1.2.3") == "10.1.2.3"
    assert host_of("fe80::1%eth0") == "fe80::1" and host_of("not-an-ip") == "not-an-ip"


def _open(srv: BrokerServer, sources: list[str], each: int) -> list[socket.socket]:
    host, port = srv.address.removeprefix("tcp://").rsplit(":", 1)
    return [
        socket.create_connection((host, int(port)), timeout=5, source_address=(src, 0))
        for src in sources
        for _ in range(each)
    ]


@pytest.mark.parametrize("cap", ["max_connections_per_host", "max_connections"])
def test_twelve_loopback_aliases_share_one_cap(tmp_path: Path, cap: str) -> None:
    """The issue's 127.0.0.2 ... 127.0.0.13: 12 addresses x 5 connections against a cap of
    20 (per host, or in all): 40 are closed as they arrive."""
    other = "max_connections" if cap == "max_connections_per_host" else "max_connections_per_host"
    with broker_server(tmp_path, f"broker.{cap}=20", f"broker.{other}=1000") as srv:
        idle = _open(srv, [f"127.0.0.{i}" for i in range(2, 14)], 5)
        try:
            conns = srv.connections
            assert wait_for(conns, lambda: conns.refused >= 40)
            assert conns.refused == 40 and conns.per_host == {"loopback": 20}
            assert hung_up(idle, 40) == 40
        finally:
            for s in idle:
                s.close()


class KeyFrame:
    def __init__(self, key: str) -> None:
        self.key = key

    def get(self, option: Any) -> Any:
        return self.key if option == "User-Id" else None


def test_connections_per_curve_key_are_capped_and_observer_keys_hold_few() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    roles = {"ACT": frozenset({"actor"}), "OBS": frozenset({"client"})}
    try:
        cap = ConnectionCap(router, max_per_host=1000, max_per_key=3, key_roles=roles)
        cap.open = {fd: "10.0.0.1" for fd in range(100, 120)}
        assert [cap.admit_key(fd, KeyFrame("ACT")) for fd in range(100, 105)] == [True] * 3 + [
            False
        ] * 2
        assert cap.admit_key(100, KeyFrame("ACT"))  # a known connection: no new count
        observer = [cap.admit_key(fd, KeyFrame("OBS")) for fd in range(105, 120)]
        assert observer.count(True) == min(3, OBSERVER_KEY_CONNECTIONS)
        cap._gone(100)  # one of the key's connections closes: room for one more
        assert cap.admit_key(104, KeyFrame("ACT")) and cap.per_key["ACT"] == 3
    finally:
        cap.close()
        router.close(linger=0)
        ctx.term()


def test_at_the_host_cap_an_idle_actor_makes_room_for_the_learner(tmp_path: Path) -> None:
    """256 actor connections from one host filled broker.max_connections_per_host and the
    run's own learner was refused. At the cap, the actor connection that holds no lease
    and has been silent longest is shut for the newcomer; a learner is never shut so."""
    from drmas.protocol.messages import Welcome
    from drmas.transports.channel import BrokerClient
    from tests.fixtures.broker_server import serving_broker

    with serving_broker(tmp_path, "broker.max_connections_per_host=4") as srv:
        actors = [BrokerClient(srv.address, f"actor-{i}") for i in range(4)]
        learner = BrokerClient(srv.address, "learner-solver-0")
        try:
            for a in actors:
                assert isinstance(a.hello("actor", ["solver", "verifier"], timeout_s=30), Welcome)
            welcome = learner.hello("learner", ["solver"], timeout_s=30, rank=0, world_size=1)
            assert isinstance(welcome, Welcome)
            assert srv.state.counters["dropped/host_cap_idle"] == 1
        finally:
            for c in [*actors, learner]:
                c.close()


def test_the_connections_of_dropped_actors_are_shut_so_the_cap_never_takes_the_honest_one(
    tmp_path: Path,
) -> None:
    """Actors that said Hello and went silent were dropped as lost but kept their
    connections: no longer actors, they were not idle actors the cap could shut, so at
    the host's cap the only one it could shut was the run's own honest actor (seen in a
    whole run beside 256 such connections: the run never finished). The broker now shuts
    a dropped client's connection; an observer's stays."""
    from drmas.protocol.messages import Heartbeat, Welcome
    from drmas.transports.channel import BrokerClient
    from tests.fixtures.broker_server import serving_broker

    def wait(check, what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.05)

    with serving_broker(
        tmp_path, "broker.max_connections_per_host=5", "broker.heartbeat_timeout_s=1",
        "broker.heartbeat_interval_s=0.2",
    ) as srv:  # fmt: skip
        silent = [BrokerClient(srv.address, f"silent-{i}") for i in range(3)]
        honest = BrokerClient(srv.address, "honest")
        observer = BrokerClient(srv.address, "observer")
        counters = srv.state.counters
        try:
            assert isinstance(observer.hello("client", [], timeout_s=30), Welcome)
            for c in [*silent, honest]:
                assert isinstance(c.hello("actor", ["solver", "verifier"], timeout_s=30), Welcome)
            # the silent ones are dropped as lost and their connections shut; honest beats
            wait(lambda: (honest.send(Heartbeat("honest")), time.sleep(0.2))
                 and counters["dropped/forgotten_client"] >= 3, "the silent were never shut")  # fmt: skip
            assert counters["dropped/forgotten_client"] == 3  # not the observer's
            learner = BrokerClient(srv.address, "learner-solver-0")
            try:  # room at the cap without shutting the honest actor
                welcome = learner.hello("learner", ["solver"], timeout_s=30, rank=0, world_size=1)
                assert isinstance(welcome, Welcome)
            finally:
                learner.close()
            assert counters["dropped/host_cap_idle"] == 0 and "honest" in srv.state.table.actors
        finally:
            for c in [*silent, honest, observer]:
                c.close()
