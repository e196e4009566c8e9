"""What `drmas retriever` (drmas/retrieval/server.py) accepts from a client, bounded before
any of it is built: how long one request may take to arrive, how many bytes it may
occupy, and how its JSON body is decoded.

A client gets `request_timeout_s` for its whole request (request line, headers and body)
and as long again for reading the answer; the time is not renewed by each byte that
arrives, so a client trickling one byte every few seconds is dropped like a silent one.
The request line and headers may take HEAD_BYTES in all, the body `max_body_bytes`
(refused from its Content-Length, before a byte of it is read). The body is decoded by
msgspec straight into the request's three fields: a value of the wrong type is refused
where it starts, so a body of a million `{}` or of 200 000 `[` builds nothing, an unknown
field is skipped without being built (nesting deeper than the interpreter's recursion
limit is refused), and every decoding error is a BadRequest the server answers with 400.
"""

from __future__ import annotations

import io
import socket
import time
from dataclasses import dataclass
from typing import Annotated

import msgspec

MAX_QUERY_CHARS = 4096
"""A longer query is refused (400)."""
HEAD_BYTES = 64 << 10
"""Bytes a request line and its headers may take together (more: 431 and closed)."""
MAX_QUERY_TERMS = 256
"""Words (whitespace-separated) one query may hold: bm25's cost grows with them."""
LARGE_BODY_BYTES = 64 << 10
"""Bodies over this are read and decoded one at a time (see handler.BodyGate)."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for and take (from RetrieverConfig)."""

    max_topk: int = 100
    max_queries: int = 1024
    max_connections: int = 64
    request_timeout_s: float = 10.0
    max_body_bytes: int = 8 << 20


class BadRequest(ValueError):
    """The request cannot be served as sent; its message is the answer's error, its status
    the answer's (400, or 413 for a body over max_body_bytes)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class HeadTooLarge(OSError):
    """The request line and headers went over HEAD_BYTES."""


class DeadlineReader(io.RawIOBase):
    """A connection's reads, each given only what is left of the request's deadline and
    byte budget (so the total, not each read, is bounded). `start` sets both; the handler
    calls it when it starts to wait for a request, and `allow` when it reads a body."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._deadline = time.monotonic()
        self._budget = 0

    def start(self, timeout_s: float, budget: int) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._budget = budget

    def allow(self, extra: int) -> None:
        self._budget += extra

    def left(self) -> float:
        """Seconds left until the request's deadline."""
        return self._deadline - time.monotonic()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview | bytearray) -> int:  # type: ignore[override]
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request did not arrive within retriever.request_timeout_s")
        if self._budget <= 0:
            raise HeadTooLarge(f"request line and headers over {HEAD_BYTES} bytes")
        self._sock.settimeout(left)
        view = memoryview(buffer)
        got = self._sock.recv_into(view[: min(len(view), self._budget)])
        self._budget -= got
        return got


class Request(msgspec.Struct):
    """Search-R1's /retrieve body. Unknown fields are ignored (skipped, never built)."""

    queries: list[Annotated[str, msgspec.Meta(max_length=MAX_QUERY_CHARS)]]
    topk: int | None = None
    return_scores: bool = False


_DECODER = msgspec.json.Decoder(Request)

_FIELD_ERRORS = {
    "$.queries": "'queries' must be a list of strings",
    "$.topk": "'topk' must be an integer",
    "$.return_scores": "'return_scores' must be true or false",
}


FIELD_STRINGS = 8
"""Strings a body may hold besides its queries (the field names, and some slack)."""


def check_count(body: bytes, limits: Limits) -> None:
    """Refuse a body with more strings than max_queries allows before it is decoded
    (msgspec builds a whole JSON list before it checks the list's length: 2.1 M queries
    in 8 MB cost +152 MB). Every JSON string has two quotes that no backslash precedes, so
    half their count never exceeds the body's strings: an honest body is never refused."""
    strings = (body.count(b'"') - body.count(b'\\"')) // 2
    if strings > limits.max_queries + FIELD_STRINGS:
        raise BadRequest(
            f"about {strings} strings in one request, at most {limits.max_queries} queries "
            "(retriever.max_queries)"
        )


def parse(body: bytes, top_k_default: int, limits: Limits) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) of a /retrieve body; BadRequest saying what is wrong.
    A topk of 0 or null means the server's default, as before."""
    check_count(body, limits)
    try:
        request = _DECODER.decode(body)
    except msgspec.ValidationError as exc:
        raise BadRequest(_explain(str(exc))) from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("body nests too deeply (a /retrieve body nests two levels)") from None
    queries = request.queries
    if len(queries) > limits.max_queries:
        raise BadRequest(f"{len(queries)} queries in one request, at most {limits.max_queries}")
    for i, query in enumerate(queries):
        if (terms := len(query.split())) > MAX_QUERY_TERMS:
            raise BadRequest(
                f"query {i} has {terms} words, at most {MAX_QUERY_TERMS}: a search query is "
                "a few words (each word costs a pass over its postings)"
            )
    top_k = request.topk or top_k_default
    if not 1 <= top_k <= limits.max_topk:
        raise BadRequest(
            f"'topk' must be an integer in 1..{limits.max_topk}, got {str(top_k)[:40]}"
        )
    return queries, top_k, request.return_scores


def _explain(error: str) -> str:
    """msgspec's message with what the field must be in front of it."""
    if error.startswith("Expected `object`"):
        return f"body must be a JSON object with 'queries' ({error})"
    if "str` of length <=" in error:
        return f"a query is longer than {MAX_QUERY_CHARS} characters ({error})"
    for path, what in _FIELD_ERRORS.items():
        if error.endswith(f"`{path}`") or f"`{path}[" in error:
            return f"{what} ({error})"
    return error
