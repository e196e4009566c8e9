"""One connection of `drmas retriever` (drmas/retrieval/server.py accepts it): reads each
request within its deadline and byte budget (drmas/retrieval/intake.py), answers /health,
and runs a /retrieve request's search under the index's lock. Large bodies pass BodyGate
one at a time, so what requests in flight hold stays bounded whatever clients send.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any, Protocol, cast

from drmas.retrieval.corpus import Passage, format_contents
from drmas.retrieval.intake import (
    HEAD_BYTES,
    LARGE_BODY_BYTES,
    BadRequest,
    DeadlineReader,
    HeadTooLarge,
    Limits,
    parse,
)

if TYPE_CHECKING:
    from drmas.retrieval import Retriever

log = logging.getLogger("drmas.retrieval")


class BodyGate:
    """Bodies over LARGE_BODY_BYTES are read and decoded one at a time, so the memory of
    requests in flight stays near max_connections x LARGE_BODY_BYTES plus one large body
    and what decoding it builds (at most ~12 bytes per byte of body, for a list of tiny
    strings), instead of max_connections x max_body_bytes."""

    def __init__(self) -> None:
        self._large = threading.Lock()

    @contextlib.contextmanager
    def admit(self, length: int, wait_s: float) -> Iterator[bool]:
        """True when the body may be read now; False when a large one found the gate taken
        for `wait_s` (what is left of the request's deadline)."""
        if length <= LARGE_BODY_BYTES:
            yield True
            return
        if not self._large.acquire(timeout=max(wait_s, 0.0)):
            yield False
            return
        try:
            yield True
        finally:
            self._large.release()


class HeadWaits:
    """Connections waiting for a request's head (its request line and headers), with when
    each began to wait. At the connection cap the server evicts the one that has waited
    longest, once it has waited EVICT_AFTER_S (server.py): slow or idle connections then
    cannot hold every slot, while an honest client, which sends its head at once, is never
    the oldest for long."""

    def __init__(self) -> None:
        self._since: dict[socket.socket, float] = {}
        self._lock = threading.Lock()

    def waiting(self, conn: socket.socket) -> None:
        with self._lock:
            self._since[conn] = time.monotonic()

    def done(self, conn: socket.socket) -> None:
        with self._lock:
            self._since.pop(conn, None)

    def evict(self, older_than_s: float, taking: Callable[[socket.socket], None]) -> bool:
        """Shut the connection that has waited longest for its head, if it has waited
        `older_than_s` (its thread then ends), after `taking(it)` (which must happen before
        that thread can end); False if none has."""
        with self._lock:
            if not self._since:
                return False
            conn, since = min(self._since.items(), key=lambda item: item[1])
            if time.monotonic() - since < older_than_s:
                return False
            del self._since[conn]
        taking(conn)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        return True


SEARCH_CHUNK = 32
"""Queries searched per hold of the index's lock."""


class FairLock:
    """A lock granted in the order it was asked for (threading.Lock is not: a thread that
    releases and asks again at once usually wins it back, so a long request chunked would
    still starve the others)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._queue: collections.deque[threading.Event] = collections.deque()

    def __enter__(self) -> FairLock:
        turn = threading.Event()
        with self._guard:
            self._queue.append(turn)
            if len(self._queue) == 1:
                turn.set()
        turn.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._guard:
            self._queue.popleft()
            if self._queue:
                self._queue[0].set()


@dataclass
class Service:
    """What every connection of one server shares."""

    retriever: Retriever
    top_k_default: int
    limits: Limits
    lock: FairLock = field(default_factory=FairLock)
    """The index is not known to be thread-safe: one search (chunk) at a time, in the
    order the requests asked."""
    gate: BodyGate = field(default_factory=BodyGate)
    heads: HeadWaits = field(default_factory=HeadWaits)


class ServiceHost(Protocol):
    """The server a Handler belongs to (server.BoundedServer): it holds the Service."""

    service: Service


class Handler(BaseHTTPRequestHandler):
    """One connection's requests; what it serves is its server's `service`."""

    protocol_version = "HTTP/1.1"
    reader: DeadlineReader
    service: Service

    def setup(self) -> None:
        self.service = cast("ServiceHost", self.server).service
        super().setup()
        self.rfile.close()  # the plain socket file; reads go through the deadline
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self) -> None:
        self.reader.start(self.service.limits.request_timeout_s, HEAD_BYTES)
        self.service.heads.waiting(self.connection)  # evictable until its head is read
        try:
            super().handle_one_request()
        except HeadTooLarge as exc:
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.connection.settimeout(1.0)
                self.connection.sendall(raw_answer(b"431 Request Header Fields Too Large",
                                                    str(exc)))  # fmt: skip

    def parse_request(self) -> bool:
        """Reads the headers; the head is then whole and the connection no longer evictable."""
        parsed = super().parse_request()
        self.service.heads.done(self.connection)
        return parsed

    def finish(self) -> None:
        self.service.heads.done(self.connection)
        super().finish()

    def handle_expect_100(self) -> bool:
        """Refuse an oversized body before the client sends it."""
        try:
            self._length()
        except BadRequest as exc:
            self._reply(exc.status, {"error": str(exc)}, close=True)
            return False
        return super().handle_expect_100()

    def do_GET(self) -> None:
        if "Content-Length" in self.headers or "Transfer-Encoding" in self.headers:
            self.close_connection = True  # a body we do not read: do not parse it next
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "retriever": repr(self.service.retriever)})
        else:
            self._reply(404, {"error": f"no such path {self.path!r}; try POST /retrieve"})

    def do_POST(self) -> None:
        if self.path.rstrip("/") != "/retrieve":
            error = f"no such path {self.path!r}; try POST /retrieve"
            self._reply(404, {"error": error}, close=True)
            return
        try:
            length = self._length()
        except BadRequest as exc:
            self._reply(exc.status, {"error": str(exc)}, close=True)
            return
        with self.service.gate.admit(length, self.reader.left()) as admitted:
            if not admitted:
                error = "busy reading another large request; retry later"
                self._reply(503, {"error": error}, close=True)
                return
            self.reader.allow(length)
            try:
                body = self.rfile.read(length)
            except TimeoutError:  # the deadline passed mid-body (a slow client, or one
                # that got the gate late in its own deadline): say so, it may retry
                error = "the body did not arrive within retriever.request_timeout_s; retry"
                self._reply(408, {"error": error}, close=True)
                return
            if len(body) < length:  # the client closed before sending it all
                self.close_connection = True
                return
            try:
                queries, top_k, with_scores = parse(
                    body, self.service.top_k_default, self.service.limits
                )
            except BadRequest as exc:
                self._reply(400, {"error": str(exc)})
                return
            del body
        self._search(queries, top_k, with_scores)

    def _search(self, queries: list[str], top_k: int, with_scores: bool) -> None:
        results: list[Any] = []
        try:
            # in chunks, the lock released between them (first come, first served): one
            # request of 1,024 queries held it 56-66 s while honest ones of a few waited
            for start in range(0, len(queries), SEARCH_CHUNK):
                with self.service.lock:
                    results += self.service.retriever.search(
                        queries[start : start + SEARCH_CHUNK], top_k
                    )
        except Exception as exc:
            log.exception("search of %d queries failed", len(queries))
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._reply(200, {"result": [_render(hits, with_scores) for hits in results]})

    def _length(self) -> int:
        if "Transfer-Encoding" in self.headers:
            raise BadRequest("send the body with a Content-Length (no Transfer-Encoding)")
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise BadRequest("a Content-Length header is required") from None
        if length < 0:
            raise BadRequest(f"Content-Length {length} is negative")
        if length > self.service.limits.max_body_bytes:
            raise BadRequest(
                f"body of {length} bytes, at most {self.service.limits.max_body_bytes} "
                "(retriever.max_body_bytes)",
                status=413,
            )
        return length

    def _reply(self, status: int, body: dict[str, Any], close: bool = False) -> None:
        """The answer, written within request_timeout_s (a client that does not read
        it is dropped then)."""
        data = json.dumps(body).encode()
        deadline = time.monotonic() + self.service.limits.request_timeout_s
        self.connection.settimeout(self.service.limits.request_timeout_s)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.connection.settimeout(max(deadline - time.monotonic(), 0.001))
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def raw_answer(status_line: bytes, error: str) -> bytes:
    """A whole JSON error answer that closes the connection, for when the request could
    not be parsed far enough to answer through the handler."""
    body = json.dumps({"error": error}).encode()
    return (
        b"HTTP/1.1 " + status_line + b"\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _render(hits: list[Passage], with_scores: bool) -> list[dict[str, Any]]:
    docs = [
        {"id": p.id, "contents": format_contents(p.title, p.text), "title": p.title, "text": p.text}
        for p in hits
    ]
    if not with_scores:
        return docs
    return [{"document": d, "score": p.score} for d, p in zip(docs, hits, strict=True)]
