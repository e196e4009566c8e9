"""ZeroMQ channel between the broker (ROUTER, binds) and its clients (DEALER, connect).

Socket semantics, written where the sockets are made:
- Broker: one ROUTER bound at `broker.address`. ROUTER_MANDATORY is on, so a reply to a
  peer that has gone raises instead of vanishing silently. Its send queue per peer is
  small (REPLY_QUEUE messages): a client's libzmq reads its replies into its own queue
  whatever its code does, so a full queue means a peer that does not read at all, and
  the broker drops it (drmas/broker/intake.py) instead of buffering for it. RECV_QUEUE
  messages per peer wait to be read. MAXMSGSIZE (the largest GroupResult the run can
  make) drops oversized frames before they are read. linger=0 on close.
- Client: one DEALER with a unique identity (its client id), connected to the broker;
  a late joiner simply connects and says Hello. While the broker's port refuses it, it
  tries again after 100 ms, doubling up to 2 s (RECONNECT_MS). Requests are retried by
  the caller; every receive has an explicit timeout. Messages the broker sends
  unsolicited (JoinWeightGroup, Shutdown) that arrive while waiting for a reply are kept
  in `inbox`.

Security of the broker socket (keys in drmas/transports/security.py; what every other
connection exposes, and the firewall recipe, in docs/security.md):
- security.curve=true: the ROUTER is a CURVE server and a ZAP handler admits only the
  client keys in KEYS_DIR/authorized/; clients are CURVE clients with their own key pair.
  A client without an authorized key (a wrong key pair, or no CURVE at all) can open a
  TCP connection and start a handshake, nothing more: the ZAP handler (or the mechanism
  mismatch) drops the handshake, so it can neither inject a frame (nothing reaches the
  broker's loop, no counter moves) nor read one (traffic is encrypted; it is sent
  nothing); its requests just time out. What it can still cost: one key lookup per
  handshake attempt and a file descriptor per open connection, like any open TCP port.
- Without CURVE the broker binds only loopback (127.0.0.0/8, ::1, localhost, ipc://,
  inproc://); any other address is refused unless security.allow_insecure=true, which
  logs a warning: then anyone who can reach the port can read and inject.
- Either way every socket keeps MAXMSGSIZE (broker.max_message_bytes), so even an
  admitted client cannot make the broker buffer an oversized frame; every admitted
  frame is still decoded and validated before it touches state (broker/server.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from drmas.config.transport import SecurityConfig
from drmas.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    decode_from_broker,
    encode,
)
from drmas.protocol.messages import ErrorReply, FromBroker, Hello, Role, Welcome
from drmas.transports.learner_secret import actor_proof, load_actor_secret
from drmas.transports.security import check_bind, secure_client, secure_server

log = logging.getLogger("drmas.transports.channel")

T = TypeVar("T")

REPLY_QUEUE = 1000
"""Replies the broker queues for one peer (SNDHWM); a peer that lets them pile up is dropped."""
RECV_QUEUE = 1000
"""Messages of one peer waiting for the broker's loop (RCVHWM)."""


SEND_TIMEOUT_S = 10.0
"""Longest a send may wait for room in the queue to the broker."""
CONNECTION_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
"""What a client's monitor records (`BrokerClient.events`)."""
HELLO_CLOSES = 3
"""Times the broker may close a connection before a Hello is answered: then it is refused
(the connection caps), not left to time out. A broker that restarts closes it once."""
RECONNECT_MS = (100, 2000)
"""A client's first and longest wait before it tries to connect again (doubling in
between) while the broker's port refuses it. libzmq 4.3 restarts the wait at the first
after a connection that was accepted and then dropped, so a client the broker shuts
right after accepting it still tries every 100-200 ms; the broker keeps each such
connection cheap (drmas/broker/connections.py, intake.py)."""


class BrokerUnavailable(TimeoutError):
    """The broker did not answer in time; says where and for what."""


class BrokerRefused(RuntimeError):
    """The broker answered with an ErrorReply; `code` is its code (e.g. unknown_client)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class _RouterSocket(zmq.Socket):
    """The broker's ROUTER; closing it also stops its ZAP handler (when CURVE is on),
    so the owner's usual close-then-ctx.term() does not hang on the handler's socket."""

    _release: Callable[[], None] | None = None  # class attribute: pyzmq treats unknown
    # instance attributes as socket options unless the class declares them

    def close(self, linger: int | None = None) -> None:
        super().close(linger)
        release, self._release = self._release, None
        if release is not None:
            release()


def seed_routing_ids() -> None:
    """Seed the counter libzmq numbers a ROUTER's connections from, before the socket exists.

    libzmq draws a ROUTER's first routing id for connections that do not name themselves
    from libc's rand(), which nothing seeded: every broker gave out 0x6B8B4567,
    0x6B8B4568, ... and a client that took the next number as its own id made libzmq
    abort the broker (an assertion, exit -6) when the counter reached it. Seeded from the
    OS, the counter starts where nobody can guess (the broker never logs ids:
    drmas/broker/peer_label.py). libzmq calls the process's libc, so seeding it here is
    seeding libzmq; nothing else in drmas uses libc's rand()."""
    libc = ctypes.CDLL(None)
    libc.srand(ctypes.c_uint(int.from_bytes(os.urandom(4), "little")))


def bind_router(
    ctx: zmq.Context,
    address: str,
    max_message_bytes: int,
    security: SecurityConfig | None = None,
) -> tuple[zmq.Socket, str]:
    """Bind the broker's ROUTER; port 0 picks a free port. Returns (socket, bound address).

    Raises SecurityError (a ValueError) for a non-loopback bind without CURVE unless
    security.allow_insecure, and when CURVE is on but its keys are missing.
    """
    security = security or SecurityConfig()
    check_bind(address, security)
    seed_routing_ids()
    sock = ctx.socket(zmq.ROUTER, socket_class=_RouterSocket)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, REPLY_QUEUE)
    sock.setsockopt(zmq.RCVHWM, RECV_QUEUE)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        if security.curve:
            sock._release = secure_server(ctx, sock, security)
        if address.endswith(":0"):
            port = sock.bind_to_random_port(address[: -len(":0")])
            address = f"{address[: -len(':0')]}:{port}"
        else:
            sock.bind(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock, address


class BrokerClient:
    """A DEALER connected to the broker, used by actors, learner ranks and `drmas status`."""

    def __init__(
        self,
        address: str,
        client_id: str,
        *,
        max_message_bytes: int = 256 * 1024 * 1024,
        ctx: zmq.Context | None = None,
        security: SecurityConfig | None = None,
    ) -> None:
        self.address = address
        self.client_id = client_id
        self._ctx = ctx or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        # no zmq.IDENTITY: the broker's ROUTER gives each connection its own routing id, and
        # the Welcome says which client id it speaks for (drmas/broker/routes.py)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 10_000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_MS[0])
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MS[1])
        # a send blocks only while the queue to the broker is full (10_000 frames): never
        # longer than this, then BrokerUnavailable
        self.sock.setsockopt(zmq.SNDTIMEO, int(SEND_TIMEOUT_S * 1000))
        self.security = security or SecurityConfig()
        if security is not None and security.curve:
            try:
                secure_client(self.sock, security)
            except BaseException:
                self.sock.close(linger=0)
                raise
        # the broker shuts a connection beyond its caps (per host, in all, per CURVE key),
        # or one whose key it refuses, before it can say anything: a Hello learns it from
        # these events, not a timeout (a socket has one monitor: read it through `events`)
        self._closed = self.sock.get_monitor_socket(CONNECTION_EVENTS)
        self._events: collections.deque[zmq.Event] = collections.deque(maxlen=256)
        self.sock.connect(address)
        self.inbox: collections.deque[FromBroker] = collections.deque()

    def events(self) -> list[zmq.Event]:
        """The connection's events so far (the last 256: disconnects and handshakes)."""
        while not self._closed.closed and self._closed.poll(0):
            self._event()
        return list(self._events)

    def _event(self) -> zmq.Event:
        event = zmq.Event(recv_monitor_message(self._closed)["event"])
        self._events.append(event)
        return event

    def send(self, message: object) -> None:
        try:
            self.sock.send(encode(message))  # type: ignore[arg-type]
        except zmq.Again:
            raise BrokerUnavailable(
                f"could not queue {type(message).__name__} for the broker at {self.address} "
                f"within {SEND_TIMEOUT_S:.0f}s: 10,000 messages wait unsent; is it running?"
            ) from None

    def recv(self, timeout_s: float) -> FromBroker | None:
        """Next message (inbox first), or None after timeout_s. Bad frames are skipped."""
        if self.inbox:
            return self.inbox.popleft()
        deadline = time.monotonic() + timeout_s
        while True:
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self.sock.poll(left_ms):
                return None
            try:
                return decode_from_broker(self.sock.recv())
            except ProtocolError:
                if time.monotonic() >= deadline:
                    return None

    def request(
        self,
        message: object,
        expect: type[T] | tuple[type, ...],
        timeout_s: float,
        max_closes: int = 0,
    ) -> T:
        """Send and wait (blocking) for a reply of type `expect`; other messages go to
        `inbox`. Processes without an event loop (learner ranks, `drmas status`) use it.
        `max_closes` > 0: raise BrokerRefused("closed") once the broker has closed the
        connection that many times without an answer (a Hello beyond its caps)."""
        self.events()  # closes before this request are not its answer
        self.send(message)
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._closed, zmq.POLLIN)
        closes = 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._unanswered(message, timeout_s)
            ready = dict(poller.poll(int(left * 1000) + 1))
            if self._closed in ready:
                closes += self._event() == zmq.EVENT_DISCONNECTED
                if max_closes and closes >= max_closes:
                    raise self._closed_on(message, closes)
            if self.sock not in ready:
                continue
            reply = self._take(message, expect)
            if reply is not None:
                return reply

    def _closed_on(self, message: object, closes: int) -> BrokerRefused:
        # a mechanism mismatch (CURVE on one side only) fails the handshake with a protocol
        # error; a connection the broker shuts at once (its caps) may fail it with no
        # detail, which says nothing about CURVE
        why = (
            "refused this client's CURVE key (security.keys_dir, security.client_name)"
            if zmq.EVENT_HANDSHAKE_FAILED_AUTH in self._events
            else "failed the handshake (is security.curve the same here as the broker's?)"
            if zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL in self._events
            else "is at a connection cap (broker.max_connections_per_host, "
            "broker.max_connections, broker.max_unwelcomed_connections, or the CURVE "
            "key's); close other connections from this host or raise the cap"
        )
        return BrokerRefused(
            f"the broker at {self.address} closed the connection {closes} times before "
            f"answering {type(message).__name__}: it {why}",
            "closed",
        )

    async def arequest(
        self,
        message: object,
        expect: type[T] | tuple[type, ...],
        timeout_s: float,
        give_up_on: tuple[type, ...] = (),
    ) -> T:
        """`request` for an asyncio loop: polls without blocking and yields between polls
        (2 ms growing to 50 ms), so the loop's other tasks (heartbeats, episodes) go on
        while the broker is slow to answer. Stops waiting (BrokerUnavailable) as soon as
        a message of a `give_up_on` type arrives (it stays in `inbox`): the actor passes
        Shutdown, after which the broker may be gone."""
        self.send(message)
        deadline = time.monotonic() + timeout_s
        pause = 0.002
        while True:
            if give_up_on and any(isinstance(m, give_up_on) for m in self.inbox):
                raise BrokerUnavailable(
                    f"the broker at {self.address} is shutting down; "
                    f"{type(message).__name__} not answered"
                )
            if time.monotonic() >= deadline:
                raise self._unanswered(message, timeout_s)
            if not self.sock.poll(0):
                await asyncio.sleep(pause)
                pause = min(pause * 2, 0.05)
                continue
            reply = self._take(message, expect)
            if reply is not None:
                return reply

    def _take(self, message: object, expect: type[T] | tuple[type, ...]) -> T | None:
        """Read one waiting frame: the reply, or None (kept in `inbox`, or a bad frame)."""
        try:
            reply = decode_from_broker(self.sock.recv())
        except ProtocolError:
            return None
        if isinstance(reply, expect):
            return reply  # type: ignore[return-value]
        tag = type(message).__struct_config__.tag  # type: ignore[attr-defined]
        if isinstance(reply, ErrorReply) and reply.refused in (tag, ""):
            raise BrokerRefused(
                f"broker refused {type(message).__name__}: {reply.reason}", reply.code
            )
        self.inbox.append(reply)  # unsolicited, or an error about a fire-and-forget message
        return None

    def _unanswered(self, message: object, timeout_s: float) -> BrokerUnavailable:
        return BrokerUnavailable(
            f"broker at {self.address} did not answer {type(message).__name__} "
            f"within {timeout_s:.0f}s; is `drmas broker` running there?"
        )

    def hello(
        self,
        role: Role,
        models: list[str],
        *,
        timeout_s: float,
        rank: int = 0,
        world_size: int = 1,
        proof: str = "",
    ) -> Welcome:
        """Say Hello and wait for the Welcome (BrokerRefused: refused, with the reason).
        `proof`: a learner's seat proof; an actor's Hello carries the proof of its client id
        under security.actor_secret when the config names one (SecurityError when that
        file cannot be read), both drmas/transports/learner_secret.py's."""
        import socket

        secret = load_actor_secret(self.security) if role == "actor" else None
        if secret is not None:
            proof = actor_proof(secret, self.client_id)

        msg = Hello(
            role=role,
            client_id=self.client_id,
            protocol_version=PROTOCOL_VERSION,
            models=models,
            rank=rank,
            world_size=world_size,
            pid=os.getpid(),
            host=socket.gethostname(),
            proof=proof,
        )
        welcome = self.request(msg, Welcome, timeout_s, max_closes=HELLO_CLOSES)
        if welcome.client_id and welcome.client_id != self.client_id:
            log.warning(
                "%s is in use by another live connection: the broker welcomed this one as %s",
                self.client_id, welcome.client_id,
            )  # fmt: skip
            self.client_id = welcome.client_id
        return welcome

    def close(self, linger_ms: int = 0) -> None:
        """Close the connection (again: nothing happens); `linger_ms`: how long what is
        still queued for the broker may take to leave."""
        if not self.sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
        self._closed.close(linger=0)
        self.sock.close(linger=linger_ms)
