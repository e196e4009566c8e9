"""The broker's watch on bytes a connection sent that the broker has not read: the one
bound on what libzmq holds for a peer before the broker can see it.

libzmq assembles a multipart message in full before it hands the broker its first part,
and its receive queue counts whole messages only: a peer that sends one message of
millions of empty parts makes libzmq keep about 64 bytes per 2-byte part (32 times what
it sent) while the broker can read nothing of it. No libzmq option bounds that, so the
broker measures it from the kernel's side:

- ConnectionCap (drmas/broker/connections.py) reports each TCP connection the ROUTER
  accepts (`accepted`) and each one that is gone (`gone`, which also clears the entry, so a
  reused file descriptor starts afresh).
- The intake (drmas/broker/intake.py) credits every message it reads to the connection it
  came from (`read`: the frame's SRCFD, its bytes plus PART_OVERHEAD per part, which is at
  least ZeroMQ's frame header, with CURVE its box too) and names the sender's identity.
- The broker loop (server.py) calls `check` each pass (it wakes every SCAN_S while
  connections are open). Every FULL_S, or at once when the broker's resident memory grew
  by RSS_TRIGGER since the last such scan (a flood shows there first), it reads each
  connection's `tcpi_bytes_received` (Linux TCP_INFO) and the bytes still in the kernel's
  receive queue (FIONREAD). What libzmq took in and the broker has not read is
  received - queued - credited. A connection over its allowance is scanned again after
  FOLLOW_S. Over it at two scans in a row, with no message read from it in between (so
  it is not a queue of complete messages the broker reads next), it is shut down
  (SHUT_RDWR: libzmq's own descriptor is never closed), counted `dropped/unread_flood`,
  and the identity its messages named (if any) dropped and banned like the intake's
  other drops; freed heap goes back to the OS once libzmq reports the connection gone
  (TRIMS times, TRIM_S apart: libzmq may free the message later than it says so).

The allowance (Intake.allowance) is SLACK plus, before Hello and for an observer, twice
`broker.max_hello_bytes`; for a learner twice `broker.max_control_bytes`; for an actor
twice that and one largest GroupResult of the run for each lease it holds, and one more
(a retried group). At 32 bytes held per byte sent, a connection can so make libzmq hold
about 32 x (16 KiB + 32 KiB) = 1.5 MB before its Hello, about 66 MB as a learner, and
as an actor about 32 times (its leases + 1) groups: 740 MB at a 21 MB group and no lease
(without CURVE anyone who reaches the port may say Hello as an actor; with CURVE, an
actor's key is trusted that far). On top, a flood grows for about SCAN_S + FOLLOW_S
before it is shut (libzmq assembled about 800 MB of empty parts a second on the 2-core
machine of docs/results.md#hostile-clients).

One budget for all connections together (`Budget`, broker.max_held_bytes): per-connection
allowances alone let many connections add up (three actors each leaving an 11 M-part
message unfinished made libzmq hold 2 GB). At each full scan the watch sums what every
connection holds unread, times the worst case per byte sent (AMPLIFICATION: 32 without
CURVE, where an empty part costs 2 bytes on the wire and 64 in libzmq; about 2 under
CURVE, whose box adds 33 bytes to every part). When that sum is over the budget and the
broker's memory also grew by more than the budget since the last scan within it (an
honest large GroupResult counts 32 times over but is not held so), it shuts the
connections holding the most, which held unread bytes at the previous full scan too with
no message read from them since, until the sum is within the budget again; never a
learner's. Counted `dropped/memory_budget`; their identities are not banned (an honest
actor cut this way reconnects, and its group, never accepted, is handed out again).

Memory goes back to the OS after any connection that held unread bytes is gone, not only
after a shut one: 240 connections that each left 46 KB unread before their Hello kept
+348 MB in the broker after they left when only shut connections were followed by trims.

Off, with one log line, where TCP_INFO is not available (not Linux); connections not over
TCP (ipc://, inproc://) are never reported by ConnectionCap, so they are not watched.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import socket
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass

from drmas.broker.peer_label import peer_label

log = logging.getLogger("drmas.broker")

SCAN_S = 0.02
"""How often the broker's memory is looked at while connections are open (the loop wakes
this often)."""
RSS_TRIGGER = 8 * 1024 * 1024
"""Growth of the broker's memory since the last full scan that starts one at once."""
FULL_S = 0.25
"""Longest time between two scans of every connection."""
FOLLOW_S = 0.005
"""Time to the next scan of a connection a scan found over its allowance."""
SCAN_SHARE = 0.02
"""Share of the loop's time full scans may take: with many connections they space out."""
PART_OVERHEAD = 64
"""Bytes credited per part read beyond its payload: ZeroMQ's frame header is 2 or 9 bytes
and a CURVE box adds 33, so a read part is never under-credited (the credit is clamped
to what the connection sent at every scan, so the surplus cannot accumulate)."""
SLACK = 16 * 1024
"""Unread bytes any connection may have beyond twice its largest message: the ZMTP or
CURVE handshake and what arrived since the last read."""
TRIMS = 8
"""Heap trims after a shut connection is gone, TRIM_S apart: libzmq reports the connection
gone when its engine stops, and frees the partial message only once the broker's socket
has taken the pipe's end, which may be later (measured: a flood shut after its sender's
Hello kept 525 MB in the broker's heap with one trim at once)."""
TRIM_S = 0.25
AMPLIFICATION = 32
"""Bytes libzmq may hold per byte a connection sent and the broker has not read, at
worst, without CURVE: an empty part is 2 bytes on the wire and a 64-byte message in
libzmq."""
AMPLIFICATION_CURVE = 2
"""The same under CURVE: every part carries a 33-byte box, so an empty part sends 35
bytes for the same 64 held."""
_TCP_INFO = getattr(socket, "TCP_INFO", None)
_BYTES_RECEIVED = 128
"""Offset of tcpi_bytes_received (u64) in Linux's struct tcp_info."""
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _getsockopt() -> Callable[..., int] | None:
    """libc's getsockopt, called on libzmq's descriptor as it is: no duplicate, no Python
    socket object that could close it (None where there is no TCP_INFO or no libc)."""
    if _TCP_INFO is None:
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).getsockopt
    except (OSError, AttributeError):
        return None


_GETSOCKOPT = _getsockopt()
_INFO = ctypes.create_string_buffer(256)
_INFO_LEN = ctypes.c_uint32(256)


@dataclass(frozen=True)
class Budget:
    """What all connections together may make libzmq hold (the module docstring):
    `total` bytes, counted as unread bytes x `amplification`; `spared(identity)` says a
    connection is never shut for it (a learner's); `shed(fd, identity)` shuts one."""

    total: int
    amplification: int
    spared: Callable[[bytes], bool]
    shed: Callable[[int, bytes], None]


class _Conn:
    __slots__ = (
        "credited", "held_at", "identity", "messages", "over_at", "received", "scanned",
        "unread",
    )  # fmt: skip

    def __init__(self) -> None:
        self.credited = 0  # bytes of the messages read from it, with PART_OVERHEAD per part
        self.received = 0  # tcpi_bytes_received at the last scan
        self.messages = 0  # messages read from it
        self.over_at = -1  # `messages` when a scan last found it over its allowance
        self.scanned = 0  # `messages` at the last scan
        self.identity = b""
        self.unread = 0  # bytes libzmq holds unread for it, at the last scan (at most)
        self.held_at = -1  # `messages` at the last full scan if it held unread bytes then


def bytes_received(fd: int) -> int:
    """tcpi_bytes_received of TCP socket `fd`, a descriptor libzmq owns (read, never
    closed). Raises OSError when it is not a TCP socket (any more)."""
    assert _GETSOCKOPT is not None and _TCP_INFO is not None
    _INFO_LEN.value = ctypes.sizeof(_INFO)
    if _GETSOCKOPT(fd, socket.IPPROTO_TCP, _TCP_INFO, _INFO, ctypes.byref(_INFO_LEN)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"TCP_INFO of descriptor {fd}: {os.strerror(errno)}")
    if _INFO_LEN.value < _BYTES_RECEIVED + 8:
        raise OSError(f"tcp_info of {_INFO_LEN.value} bytes has no tcpi_bytes_received")
    return int(struct.unpack_from("Q", _INFO, _BYTES_RECEIVED)[0])


def bytes_queued(fd: int) -> int:
    """Bytes in the kernel's receive queue of `fd`, which libzmq has not taken in yet."""
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int(struct.unpack("i", buf)[0])


class WireWatch:
    """`allowance(identity)` is the allowance of a connection whose messages named
    `identity` (b"" before any); `flood(fd, identity)` drops a connection over it."""

    def __init__(
        self,
        allowance: Callable[[bytes], int],
        flood: Callable[[int, bytes], None],
        trim: Callable[[], None],
        budget: Budget | None = None,
    ) -> None:
        self.allowance, self.flood, self.trim, self.budget = allowance, flood, trim, budget
        self.conns: dict[int, _Conn] = {}
        self.shut: set[int] = set()  # connections shut for a flood, until libzmq says gone
        self.floods = 0
        self.enabled = _GETSOCKOPT is not None
        if not self.enabled:
            log.warning(
                "no TCP_INFO on this platform: the broker does not watch unread bytes per "
                "connection, so one many-part message can make libzmq hold memory"
            )
        self._statm = -1
        if self.enabled:
            with contextlib.suppress(OSError):
                self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self._rss = self._rss_now()  # at the last full scan
        self._rss_within = self._rss  # at the last full scan that found the budget kept
        self._next_check = self._next_full = 0.0
        self._trims_left, self._next_trim = 0, 0.0
        self.suspects: set[int] = set()  # over their allowance at the last scan
        self._over_budget = False  # all connections together were at the last full scan

    @property
    def poll_ms(self) -> int:
        """How long the broker loop may wait for a message before the next `check`."""
        if not self.conns:
            return 100
        return max(1, round(1000 * (FOLLOW_S if self.suspects or self._over_budget else SCAN_S)))

    def accepted(self, fd: int) -> None:
        if self.enabled:
            self.conns[fd] = _Conn()  # a reused descriptor starts afresh

    def gone(self, fd: int) -> None:
        conn = self.conns.pop(fd, None)
        self.suspects.discard(fd)
        held = conn is not None and conn.unread > SLACK
        if fd in self.shut or held:
            self.shut.discard(fd)
            self._trims_left = TRIMS  # libzmq frees the partial message with the pipe

    def read(self, fd: int, identity: bytes, nbytes: int, parts: int) -> None:
        """A message of `parts` parts and `nbytes` payload bytes read from `fd`."""
        conn = self.conns.get(fd)
        if conn is not None:
            conn.credited += nbytes + PART_OVERHEAD * parts
            conn.messages += 1
            conn.identity = identity

    def check(self, now: float) -> None:
        """Scan what is due (see the module docstring): every connection each FULL_S or
        once the broker's memory grew by RSS_TRIGGER, the suspects after FOLLOW_S."""
        if self._trims_left and now >= self._next_trim:
            self._trims_left -= 1
            self._next_trim = now + TRIM_S
            self.trim()
        if not self.conns or now < self._next_check:
            return
        rss = self._rss_now()
        self._rss = min(self._rss, rss)  # growth counts from the lowest since the last scan
        if rss - self._rss >= RSS_TRIGGER or now >= self._next_full:
            started = time.perf_counter()
            self._scan(list(self.conns))
            self._over_budget = self._keep_budget(rss)
            self._rss = rss
            cost = time.perf_counter() - started
            soon = FOLLOW_S if self._over_budget else FULL_S  # a flood grows FOLLOW_S more
            self._next_full = now + max(soon, cost / SCAN_SHARE)
        elif self.suspects:
            self._scan(list(self.suspects))
        # after the scan: a connection it found over its allowance is looked at again soon
        self._next_check = now + (FOLLOW_S if self.suspects or self._over_budget else SCAN_S)

    def close(self) -> None:
        if self._statm >= 0:
            os.close(self._statm)
            self._statm = -1

    def _rss_now(self) -> int:
        """The broker's resident memory in bytes (0 where it cannot be read)."""
        try:
            return int(os.pread(self._statm, 64, 0).split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            return 0

    def _scan(self, fds: list[int]) -> None:
        for fd in fds:
            self.suspects.discard(fd)
            conn = self.conns.get(fd)
            if conn is None or fd in self.shut or not self._over(fd, conn):
                continue
            self.shut.add(fd)
            self.floods += 1
            if self.floods == 1 or self.floods % 100 == 0:
                log.warning(
                    "connection %d (%s) holds more unread bytes than it may send: shut "
                    "(%d so far)", fd, peer_label(conn.identity), self.floods,
                )  # fmt: skip
            self.flood(fd, conn.identity)

    def _keep_budget(self, rss: int) -> bool:
        """After a full scan: shut the largest holders while all connections together are
        over the budget and memory grew past it (the module docstring). True if they were
        over it (the next full scan comes FOLLOW_S later)."""
        if self.budget is None:
            return False
        live = [(fd, c) for fd, c in self.conns.items() if fd not in self.shut]
        held = self.budget.amplification * sum(c.unread for _, c in live)
        if held <= self.budget.total:
            self._rss_within = rss
        elif rss - self._rss_within > self.budget.total:
            holders = sorted(live, key=lambda item: item[1].unread, reverse=True)
            for fd, conn in holders:
                if held <= self.budget.total or conn.unread <= SLACK:
                    break
                if conn.held_at != conn.messages or self.budget.spared(conn.identity):
                    continue  # not holding since the last scan, or a learner's
                held -= self.budget.amplification * conn.unread
                self.shut.add(fd)
                self.budget.shed(fd, conn.identity)
        for fd, conn in live:
            conn.held_at = conn.messages if conn.unread > SLACK and fd not in self.shut else -1
        return held > self.budget.total

    def _over(self, fd: int, conn: _Conn) -> bool:
        """True if `conn` is over its allowance now and was at the last scan, with no
        message read from it since."""
        try:
            received = bytes_received(fd)
        except OSError:
            return False  # gone already: the monitor will say so
        if received < conn.received:  # a new connection on a reused descriptor
            conn.credited, conn.messages, conn.over_at, conn.identity = 0, 0, -1, b""
            conn.scanned = 0
        conn.received = received
        allowance = self.allowance(conn.identity)
        if received - conn.credited > allowance or conn.messages != conn.scanned:
            # over it, or credited since the last scan: exactly, and with no surplus credit
            # carried over (an idle connection costs one system call, not two)
            with contextlib.suppress(OSError):
                received -= bytes_queued(fd)  # not taken in by libzmq yet
            conn.credited = min(conn.credited, received)
            conn.scanned = conn.messages
        conn.unread = max(0, received - conn.credited)
        if received - conn.credited <= allowance:
            conn.over_at = -1
            return False
        if conn.over_at == conn.messages:
            return True
        conn.over_at = conn.messages
        self.suspects.add(fd)
        return False
