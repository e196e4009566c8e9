"""Bounded reading of the broker's ROUTER: what one peer can make the broker hold, read or
decode, checked on the raw frames before msgspec sees a byte.

The broker loop (drmas/broker/server.py) reads every message through `Intake.read`. A
message is [identity, payload]. Before decoding:
- parts: a message of more parts is read to its end and each extra part dropped as it is
  read (nothing kept): `too_many_parts`;
- size: the payload against what its sender may send: before its Hello, and as an
  observer, `broker.max_hello_bytes` (a Hello or a StatusRequest); a registered actor or
  learner `broker.max_control_bytes`, except an actor's GroupResult (its leading type tag
  says so) up to the socket's ceiling: `too_large`;
- bytes: a budget per peer, refilled at `broker.max_peer_bytes_per_s` up to twice its
  largest frame (or two seconds of the rate): `over_budget`.
StatusRequest, which anyone may send, is rate-limited per peer and in all
(`allow_status`, called after decoding, so a reordered tag cannot dodge it).

Each refusal is counted (`refused/<code>`) and is a strike; a peer with STRIKES strikes
within a minute is dropped, and so is one whose reply queue is full (it does not read):
its connection is shut (drmas/broker/connections.py) and its identity banned for a
back-off that doubles on each drop (1 s up to 5 min); what it sends meanwhile is discarded
unread and shuts its connection again.

libzmq hands over a multipart message only once all its parts arrived and keeps each
part (64 bytes for an empty one) until then: the WireWatch created here
(drmas/broker/wire_watch.py) shuts a connection that makes libzmq hold more than its
`allowance` unread (`dropped/unread_flood`), crediting it with each message `read` takes
from it. What such a message still costs is bounded by that allowance (about 1.5 MB
before Hello) and the ~2 µs per part it costs to discard one that fits. All connections
together are held to broker.max_held_bytes by the same watch: over it, `shed` shuts the
largest holders (`dropped/memory_budget`, no ban), never a learner's.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from drmas.broker.connections import ConnectionCap
from drmas.broker.wire_watch import (
    AMPLIFICATION,
    AMPLIFICATION_CURVE,
    SLACK,
    Budget,
    WireWatch,
)
from drmas.config.broker import BrokerConfig

_NOBLOCK = int(zmq.NOBLOCK)
STRIKES = 8
"""Refusals before decoding, within a minute, after which a peer is dropped."""
BAN_S = (1.0, 300.0)
"""First and longest ban of a dropped identity (doubling in between)."""
STATUS_PER_S = 2.0
"""StatusRequests one peer may send per second, sustained (bursts of STATUS_BURST)."""
STATUS_BURST = 8
STATUS_TOTAL_PER_S = 50.0
"""StatusRequests answered per second from all peers together."""
MAX_PEERS = 65_536
"""Peers tracked at once; beyond it the oldest idle ones are forgotten."""
TRIM_AFTER_PARTS = 65_536
"""Parts of one discarded message after which freed memory is handed back to the OS."""
_GROUP_TAG = b"\xa4type\xacgroup_result"  # msgspec writes the tag first


@dataclass(frozen=True)
class FrameLimits:
    """Largest frame per kind of sender; `group` is the socket's ceiling."""

    hello: int
    control: int
    group: int
    bytes_per_s: int
    held: int = BrokerConfig.max_held_bytes  # the one default, the config's
    """broker.max_held_bytes: what all connections together may make libzmq hold unread."""
    curve: bool = False


@dataclass(frozen=True)
class Refusal:
    """A message refused before decoding; answered unless its sender was dropped."""

    identity: bytes
    code: str
    reason: str
    answer: bool = True


class _Peer:
    __slots__ = ("budget", "fd", "seen", "status", "status_at", "strike_at", "strikes")

    def __init__(self, now: float, budget: float) -> None:
        self.budget, self.seen, self.fd = budget, now, -1
        self.strikes, self.strike_at = 0, now
        self.status, self.status_at = float(STATUS_BURST), now


def _trim() -> None:
    """Hand freed heap pages back to the OS (glibc's malloc_trim; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def is_group_result(payload: memoryview | bytes) -> bool:
    """The payload is a map whose first key is `type` = "group_result" (how msgspec
    writes a GroupResult; a hand-made frame that puts the tag later is not one here)."""
    if not payload:
        return False
    first = payload[0]
    offset = 1 if 0x80 <= first <= 0x8F else 3 if first == 0xDE else 5 if first == 0xDF else 0
    return offset > 0 and bytes(payload[offset : offset + len(_GROUP_TAG)]) == _GROUP_TAG


class Intake:
    """Reads the ROUTER for the broker loop. `role_of(identity)` is the registered role
    ("actor", "learner") of the client a connection speaks for, or None;
    `leases_of(identity)` the leases that client holds as an actor;
    `counters` is BrokerState's."""

    def __init__(
        self,
        sock: zmq.Socket,
        limits: FrameLimits,
        connections: ConnectionCap,
        counters: collections.Counter[str],
        role_of: Callable[[bytes], str | None],
        leases_of: Callable[[bytes], int] = lambda _identity: 0,
    ) -> None:
        self.sock, self.limits, self.connections = sock, limits, connections
        self.counters, self.role_of, self.leases_of = counters, role_of, leases_of
        self.peers: dict[bytes, _Peer] = {}
        amplification = AMPLIFICATION_CURVE if limits.curve else AMPLIFICATION
        budget = Budget(limits.held, amplification, self.is_learner, self.shed)
        self.watch = WireWatch(self.allowance, self.flood, _trim, budget)
        connections.watch = self.watch
        connections.counters = counters
        connections.welcomed = self._welcomed
        connections.spoke = lambda fd: fd in self.identity_at
        connections.idle_rank = self._idle_rank
        connections.on_gone = self._gone
        self.identity_at: dict[int, bytes] = {}  # connection (fd) -> identity its messages named
        self.banned: dict[bytes, tuple[float, float]] = {}  # identity -> (until, ban length)
        # told of each connection dropped (the broker lets its client's name go with it)
        self.on_drop: Callable[[bytes], None] = lambda _identity: None
        self._status_total, self._status_at = STATUS_TOTAL_PER_S, time.monotonic()

    def read(self) -> list[zmq.Frame] | Refusal:
        """The next message as its [identity, payload] frames, or its Refusal (counted).
        Raises zmq.Again when nothing waits."""
        recv = self.sock.recv
        head = recv(_NOBLOCK, copy=False)
        identity = head.bytes
        payload = recv(_NOBLOCK, copy=False) if head.more else None
        extra = 0
        nbytes = 0 if payload is None else len(payload)
        if payload is not None and payload.more:
            part = payload
            while part.more:  # dropped as read: only a count and a length are kept
                part = recv(_NOBLOCK, copy=False)
                extra += 1
                nbytes += len(part)
            if extra > TRIM_AFTER_PARTS:
                _trim()  # libzmq freed them; without this glibc keeps the pages
        now = time.monotonic()
        fd = head.get(zmq.SRCFD)
        self.watch.read(fd, identity, nbytes, extra + 1)
        peer = self._peer(identity, now, head, fd)
        ban = self.banned.get(identity)
        if ban is not None and now < ban[0]:
            return self._banned(identity, peer)
        if payload is None or extra:
            got = 0 if payload is None else extra + 1
            return self._strike(identity, peer, now, "too_many_parts" if extra else "bad_frame",
                                f"expected 1 payload part, got {got}", weight=STRIKES // 2 if extra else 1)  # fmt: skip
        size = len(payload.buffer)
        limit = self.frame_limit(identity, payload)
        if size > limit:
            return self._strike(identity, peer, now, "too_large",
                                f"a frame of {size} bytes; this sender may send at most {limit}")  # fmt: skip
        rate = self.limits.bytes_per_s
        peer.budget = min(2.0 * max(limit, rate), peer.budget + (now - peer.seen) * rate)
        peer.seen = now
        if size > peer.budget:
            return self._strike(identity, peer, now, "over_budget",
                                f"more than broker.max_peer_bytes_per_s={rate} bytes per second")  # fmt: skip
        peer.budget -= size
        return [head, payload]

    def frame_limit(self, identity: bytes, payload: zmq.Frame) -> int:
        """The largest payload this sender may send now (see the module docstring)."""
        role = self.role_of(identity)
        if role is None:
            return self.limits.hello
        if role == "actor" and is_group_result(payload.buffer[:32]):
            return self.limits.group
        return self.limits.control

    def allow_status(self, identity: bytes) -> Refusal | None:
        """None if this peer's StatusRequest may be answered now (per peer and in all),
        else its Refusal (counted, a strike)."""
        now = time.monotonic()
        self._status_total = min(
            STATUS_TOTAL_PER_S, self._status_total + (now - self._status_at) * STATUS_TOTAL_PER_S
        )
        self._status_at = now
        peer = self.peers.get(identity)
        if peer is None:
            return None  # not read through `read` (a test calling handle directly)
        peer.status = min(float(STATUS_BURST), peer.status + (now - peer.status_at) * STATUS_PER_S)
        peer.status_at = now
        if peer.status < 1.0 or self._status_total < 1.0:
            return self._strike(
                identity, peer, now, "rate_limited",
                f"StatusRequest at most {STATUS_PER_S:g} a second per client; ask less often",
            )  # fmt: skip
        peer.status -= 1.0
        self._status_total -= 1.0
        return None

    def drop(self, identity: bytes, why: str) -> None:
        """Shut this peer's connection and ban its identity (doubling back-off)."""
        now = time.monotonic()
        _until, length = self.banned.get(identity, (0.0, BAN_S[0] / 2))
        length = min(BAN_S[1], 2 * length)
        self.banned[identity] = (now + length, length)
        self.counters[f"dropped/{why}"] += 1
        self.on_drop(identity)
        peer = self.peers.pop(identity, None)
        if peer is not None and peer.fd >= 0:
            self.connections.shut(peer.fd)

    def allowance(self, identity: bytes) -> int:
        """Bytes libzmq may hold unread for a connection whose messages named `identity`
        (b"": none yet), beyond SLACK (drmas/broker/wire_watch.py): twice its largest
        message before Hello or as an observer (a Hello) or a learner (a control message);
        an actor two control messages and a GroupResult for each lease it holds, and one
        more (a retried one)."""
        role = self.role_of(identity) if identity else None
        if role == "actor":
            groups = self.leases_of(identity) + 1
            return SLACK + 2 * self.limits.control + groups * self.limits.group
        return SLACK + 2 * (self.limits.control if role == "learner" else self.limits.hello)

    def flood(self, fd: int, identity: bytes) -> None:
        """Connection `fd` holds more unread than its allowance: shut it, and drop and ban
        the identity its messages named (if any)."""
        if identity:
            self.drop(identity, "unread_flood")
        else:
            self.counters["dropped/unread_flood"] += 1
        self.connections.shut(fd)

    def _gone(self, fd: int) -> None:
        self.identity_at.pop(fd, None)

    def close_forgotten(self, identities: list[bytes]) -> None:
        """Shut the connections of clients the broker no longer knows (dropped as lost or
        for missed joins, or gone): silent, they would hold their host's connection slots
        while no longer evictable as idle actors, and the host cap would then shut the
        run's own honest actor. A live client reconnects and says Hello again."""
        if not identities:
            return
        forgotten = set(identities)
        for fd in [fd for fd, identity in self.identity_at.items() if identity in forgotten]:
            self.counters["dropped/forgotten_client"] += 1
            self.connections.shut(fd)

    def _welcomed(self, fd: int) -> bool:
        """Whether connection `fd`'s messages named a registered client."""
        identity = self.identity_at.get(fd)
        return identity is not None and self.role_of(identity) is not None

    def _idle_rank(self, fd: int) -> float | None:
        """For ConnectionCap._make_room: when connection `fd`'s actor last sent anything,
        if it is an actor holding no lease (the longest silent is shut first); None for
        every other connection (learners, busy actors, and those without a Hello, which
        broker.max_unwelcomed_connections bounds on its own)."""
        identity = self.identity_at.get(fd)
        if identity is None or self.role_of(identity) != "actor" or self.leases_of(identity):
            return None
        peer = self.peers.get(identity)
        return peer.seen if peer is not None else self.connections.opened_at.get(fd, 0.0)

    def is_learner(self, identity: bytes) -> bool:
        return bool(identity) and self.role_of(identity) == "learner"

    def shed(self, fd: int, identity: bytes) -> None:
        """Shut connection `fd` to keep all connections within broker.max_held_bytes; its
        client may reconnect at once (not banned: it was not over its own allowance)."""
        self.counters["dropped/memory_budget"] += 1
        if identity:
            self.on_drop(identity)
            self.peers.pop(identity, None)
        self.connections.shut(fd)

    def tick(self, now: float) -> None:
        """Forget peers idle for a minute and bans that ended (called every ~0.5 s)."""
        for identity in [i for i, p in self.peers.items() if now - p.seen > 60.0]:
            del self.peers[identity]
        for identity in [i for i, (until, n) in self.banned.items() if now > until + 4 * n]:
            del self.banned[identity]  # a ban that ended long ago: the back-off restarts

    # ------------------------------------------------------------------ helpers
    def _peer(self, identity: bytes, now: float, head: zmq.Frame, fd: int) -> _Peer:
        peer = self.peers.get(identity)
        if peer is None:
            if len(self.peers) >= MAX_PEERS:
                oldest = min(self.peers, key=lambda i: self.peers[i].seen)
                del self.peers[oldest]
            start = 2.0 * max(self.limits.hello, self.limits.bytes_per_s)  # a full budget
            peer = self.peers[identity] = _Peer(now, start)
        if fd != peer.fd:
            peer.fd = fd
            self.identity_at[fd] = identity
            if not self.connections.admit_key(fd, head):
                self.drop(identity, "key_cap")
        return peer

    def _banned(self, identity: bytes, peer: _Peer) -> Refusal:
        """A message from a banned identity: discarded unread, its connection shut again."""
        self.counters["refused/banned"] += 1
        if peer.fd >= 0:
            self.connections.shut(peer.fd)
        self.peers.pop(identity, None)
        return Refusal(identity, "banned", "", answer=False)

    def _strike(
        self, identity: bytes, peer: _Peer, now: float, code: str, reason: str, weight: int = 1
    ) -> Refusal:
        """Count the refusal; a peer at STRIKES within a minute is dropped (no answer)."""
        self.counters[f"refused/{code}"] += 1
        if now - peer.strike_at > 60.0:
            peer.strikes, peer.strike_at = 0, now
        peer.strikes += weight
        if peer.strikes >= STRIKES:
            self.drop(identity, code)
            return Refusal(identity, code, reason, answer=False)
        return Refusal(identity, code, reason)
