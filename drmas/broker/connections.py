"""Caps on the broker's open connections: per peer host, in all, and per CURVE key.

libzmq accepts every TCP connection to the ROUTER and keeps each one (its buffers, ~25 KB)
until the peer closes it; it has no per-peer limit. The broker loop (server.py) owns one
ConnectionCap: it watches the ROUTER's monitor socket, counts accepted connections per
peer host and in all, and shuts down (SHUT_RDWR on a duplicate of the file descriptor
libzmq reports) each connection beyond `max_per_host` or `max_total`, except that a host at
its cap first loses its actor connection that holds no lease and has been silent longest
(`idle_rank`, from the intake), so a host's idle actors cannot keep the run's learner
out. libzmq then sees the
peer gone and closes its side cleanly, so no file descriptor is ever closed under libzmq's
feet. Every loopback address (127.0.0.0/8, ::1) is one host, so aliases such as 127.0.0.2
share one cap; an IPv4-mapped IPv6 address is its IPv4 host. Connections not over TCP
(ipc://, inproc://) have no peer host and are not counted.

With CURVE the key of a connection is known from its first message (its ZAP User-Id):
the broker's intake (drmas/broker/intake.py) asks `admit_key` for each new connection
and drops the ones beyond `max_per_key` (OBSERVER_KEY_CONNECTIONS for a key that may only
observe). `shut` is how the intake drops a peer.

Connections whose messages never named a registered client (before their Hello, or an
observer's) are capped too, `max_unwelcomed`: each can make libzmq hold about 1.5 MB of a
message the broker cannot read yet (wire_watch.py), and 240 of them held 348 MB at once.
At the cap a new connection closes one such connection of the host that holds the most of
them (`dropped/unwelcomed_cap`): its oldest that has sent nothing, else its oldest. The
newcomer always gets in, so a host that keeps opening connections churns through its own
and a client beside it (`drmas status` on the flooding host) has the time the flood takes
to open `max_unwelcomed` more to say something; refusing newcomers while the cap's
connections were young kept every newcomer from that host out for as long as the flood
lasted. Each TCP connection it admits, and each
one gone, it also reports to the intake's WireWatch (drmas/broker/wire_watch.py), which
bounds the bytes libzmq holds for a connection before the broker can read them.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from drmas.broker.wire_watch import WireWatch

log = logging.getLogger("drmas.broker")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED
UNWELCOMED_GRACE_S = 1.0
"""How long a connection may stay without a Hello before a newcomer over the cap may take
its place."""
OBSERVER_KEY_CONNECTIONS = 8
"""Connections a CURVE key that may neither act nor learn (an observer's) may hold."""


def host_of(address: str) -> str:
    """The host a connection counts against: "loopback" for any loopback address, the
    IPv4 address of an IPv4-mapped IPv6 one, else the address itself."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return "loopback" if ip.is_loopback else str(ip)


class ConnectionCap:
    def __init__(
        self,
        router: zmq.Socket,
        max_per_host: int,
        max_total: int = 1 << 30,
        max_per_key: int = 1 << 30,
        key_roles: dict[str, frozenset[str]] | None = None,
        max_unwelcomed: int = 1 << 30,
    ) -> None:
        self.max_per_host, self.max_total, self.max_per_key = max_per_host, max_total, max_per_key
        self.max_unwelcomed = max_unwelcomed
        self.opened_at: dict[int, float] = {}  # fd -> when it was accepted (monotonic)
        self.evicted: set[int] = set()  # shut for a newcomer, until libzmq reports it gone
        # set by the intake: whether a connection's messages named a registered client, and
        # the broker's counters
        self.welcomed: Callable[[int], bool] = lambda _fd: False
        self.spoke: Callable[[int], bool] = lambda _fd: False  # any message read from it
        self.on_gone: Callable[[int], None] = lambda _fd: None
        # (set by the broker) how idle a connection is, lowest first to be shut when its
        # host is at the cap; None: never shut for a newcomer (a learner, a busy actor)
        self.idle_rank: Callable[[int], float | None] = lambda _fd: None
        self.counters: collections.Counter[str] = collections.Counter()
        self.key_roles = key_roles  # None: no CURVE, no key to count
        self.monitor = router.get_monitor_socket(_EVENTS)
        self.open: dict[int, str] = {}  # fd -> peer host
        self.per_host: collections.Counter[str] = collections.Counter()
        self.fd_key: dict[int, str] = {}  # fd -> CURVE key (z85), once a message told it
        self.per_key: collections.Counter[str] = collections.Counter()
        self.refused = 0
        self.watch: WireWatch | None = None  # told of each TCP connection (intake sets it)

    def poll(self) -> None:
        """Handle the monitor events waiting now (non-blocking)."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            else:  # disconnected or closed
                self._gone(fd)

    def _gone(self, fd: int) -> None:
        if self.watch is not None:
            self.watch.gone(fd)
        self.on_gone(fd)
        self.opened_at.pop(fd, None)
        self.evicted.discard(fd)
        host = self.open.pop(fd, None)
        if host:  # "" once shut to make room: already freed
            self.per_host[host] -= 1
            if self.per_host[host] <= 0:
                del self.per_host[host]
        key = self.fd_key.pop(fd, None)
        if key is not None:
            self.per_key[key] -= 1
            if self.per_key[key] <= 0:
                del self.per_key[key]

    def _accepted(self, fd: int) -> None:
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return  # already gone
        with dup:
            try:
                host = host_of(str(dup.getpeername()[0]))
            except (OSError, IndexError, TypeError):
                return  # not a TCP peer
            over = (
                f"{host} holds {self.per_host[host]} connections (broker.max_connections_per_host)"
                if self.per_host[host] >= self.max_per_host and not self._make_room(host)
                else f"{len(self.open)} connections are open (broker.max_connections)"
                if len(self.open) >= self.max_total
                else ""
            )
            if over:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    log.warning("%s: closing new ones (%d so far)", over, self.refused)
                with contextlib.suppress(OSError):
                    dup.shutdown(socket.SHUT_RDWR)
                return
        self._room_for_unwelcomed(fd, host)
        self.open[fd] = host
        self.opened_at[fd] = time.monotonic()
        self.per_host[host] += 1
        if self.watch is not None:
            self.watch.accepted(fd)

    def _make_room(self, host: str) -> bool:
        """`host` is at max_per_host: shut its oldest connection that has said no Hello
        for over UNWELCOMED_GRACE_S, else its actor connection that holds no lease and has
        been silent longest (`idle_rank`), so the newcomer, which may be the run's own
        learner, gets in (True); False when none is such. 256 actor connections from one
        host used to keep the run's learner out (an honest actor shut so says Hello again),
        and once they were dropped their reconnections kept only the honest actor to shut."""
        now = time.monotonic()
        ranked: list[tuple[tuple[int, float], int]] = []  # ((0 mute | 1 idle, since), fd)
        for fd, h in self.open.items():
            if h != host or fd in self.evicted:
                continue
            opened = self.opened_at.get(fd, now)
            if not self.welcomed(fd) and now - opened > UNWELCOMED_GRACE_S:
                ranked.append(((0, opened), fd))
            elif (rank := self.idle_rank(fd)) is not None:
                ranked.append(((1, rank), fd))
        if not ranked:
            return False
        (kind, _), fd = min(ranked)
        self.counters["dropped/host_cap_unwelcomed" if kind == 0 else "dropped/host_cap_idle"] += 1
        self.shut(fd)
        self.evicted.add(fd)
        self.per_host[host] -= 1  # counted free now; `_gone` must not free it twice
        self.open[fd] = ""  # ... so it leaves `open` under no host
        return True

    def _room_for_unwelcomed(self, fd: int, host: str) -> None:
        """At max_unwelcomed connections without a registered client, close one to make
        room for `fd`: of the host holding the most of them (the newcomer's host on a tie),
        the oldest that has sent nothing, else the oldest."""
        unwelcomed = [f for f in self.open if f not in self.evicted and not self.welcomed(f)]
        if len(unwelcomed) < self.max_unwelcomed:
            return
        per_host = collections.Counter(self.open[f] for f in unwelcomed)
        hog = max(per_host, key=lambda h: (per_host[h], h == host))
        oldest = min(
            (f for f in unwelcomed if self.open[f] == hog),
            key=lambda f: (self.spoke(f), self.opened_at[f]),
        )
        self.counters["dropped/unwelcomed_cap"] += 1
        self.shut(oldest)
        self.evicted.add(oldest)  # shut once; it leaves `open` when it is gone

    def admit_key(self, fd: int, frame: zmq.Frame) -> bool:
        """A message arrived on connection `fd`: False if its CURVE key holds too many
        connections already (the caller drops it). Without CURVE, always True."""
        if self.key_roles is None or fd < 0 or fd in self.fd_key or fd not in self.open:
            return True
        key = str(frame.get("User-Id"))
        roles = self.key_roles.get(key, frozenset())
        acts = any(r.startswith(("actor", "learner")) for r in roles)
        cap = self.max_per_key if acts else min(self.max_per_key, OBSERVER_KEY_CONNECTIONS)
        if self.per_key[key] >= cap:
            self.refused += 1
            return False
        self.fd_key[fd] = key
        self.per_key[key] += 1
        return True

    def shut(self, fd: int) -> None:
        """Shut down an open connection the monitor reported (the intake drops a peer);
        an fd no longer open is left alone, it may be another connection's by now."""
        if fd not in self.open:
            return
        try:
            dup = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        with dup, contextlib.suppress(OSError):
            dup.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.monitor.close(linger=0)
        if self.watch is not None:
            self.watch.close()
