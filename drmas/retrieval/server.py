"""`drmas retriever`: a bm25 or dense index served over HTTP in Search-R1's API, so many
actors (on many nodes) share one index instead of each loading its own.

    POST /retrieve  {"queries": [...], "topk": k, "return_scores": bool}  -> {"result": [...]}
    GET  /health    -> {"status": "ok", "retriever": "..."}

One thread per connection (stdlib ThreadingHTTPServer), at most `max_connections` at once
(more are answered 503 and closed); every socket read and write times out after
SOCKET_TIMEOUT_S, so a stalled client holds its thread that long at most. The index is
not known to be thread-safe, so the searches themselves run one request at a time under
a lock (an actor already sends a turn's queries as one batch). Bad requests (a body over
MAX_BODY_BYTES, topk over `max_topk`, more than `max_queries` queries or one longer than
MAX_QUERY_CHARS) get 400 with {"error": ...}; a failing search 500. There is no
authentication: like the broker, it binds only loopback unless told otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from drmas.retrieval.corpus import Passage, format_contents

if TYPE_CHECKING:
    from drmas.config import DrmasConfig
    from drmas.retrieval import Retriever

log = logging.getLogger("drmas.retrieval")

MAX_BODY_BYTES = 8 << 20
"""Larger request bodies are refused (400) before reading."""
MAX_QUERY_CHARS = 4096
"""A longer query is refused (400)."""
SOCKET_TIMEOUT_S = 30.0
"""Every read and write on a connection; an idle keep-alive connection closes after it."""
REFUSERS = 8
"""Connections over the cap answered 503 at once (each by a thread for at most ~2 s); more
than that are closed unanswered."""
REFUSAL_DRAIN_BYTES = 1 << 20
"""Request bytes read from a refused connection before it is closed anyway."""


class Limits:
    """What one request may ask for (from RetrieverConfig)."""

    def __init__(self, max_topk: int = 100, max_queries: int = 1024, max_connections: int = 64):
        self.max_topk, self.max_queries, self.max_connections = (
            max_topk,
            max_queries,
            max_connections,
        )


def check_bind(host: str, allow_remote: bool) -> None:
    """Refuse a bind other hosts can reach unless allowed (then warn): the API has no
    authentication, so anyone who reaches the port can use the index."""
    from drmas.transports.security import SecurityError, is_loopback

    if is_loopback(f"tcp://{host}:0"):
        return
    if not allow_remote:
        raise SecurityError(
            f"refusing to serve the retriever on {host}: its HTTP API has no authentication, "
            "so any host that reaches the port could use it. Bind 127.0.0.1, or, on a network "
            "of trusted hosts (or behind a firewall admitting only the actors' nodes), set "
            "retriever.allow_remote=true"
        )
    log.warning("retriever bound to %s without authentication (retriever.allow_remote=true)", host)


class BoundedServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on connections served at once."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.refusing = threading.BoundedSemaphore(REFUSERS)
        self.refused = 0
        self._serving = 0
        self._count = threading.Lock()

    @property
    def serving(self) -> int:
        """Connections holding a slot now (at most max_connections)."""
        with self._count:
            return self._serving

    def _served(self, change: int) -> None:
        with self._count:
            self._serving += change

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            if self.refusing.acquire(blocking=False):  # answered 503 off the accept loop
                threading.Thread(target=self._refuse, args=(request,), daemon=True).start()
            else:  # a flood: beyond REFUSERS at once, closed without an answer
                self.shutdown_request(request)
            return
        self._served(+1)
        super().process_request(request, client_address)

    def _refuse(self, request: Any) -> None:
        """503, then read what the client is still sending before closing: closing a socket
        with unread data resets the connection, and the client would see a broken pipe
        instead of the answer."""
        try:
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                body = b'{"error": "too many connections; retry later"}'
                request.sendall(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Connection: close\r\nContent-Length: " + str(len(body)).encode()
                    + b"\r\n\r\n" + body
                )  # fmt: skip
                request.shutdown(socket.SHUT_WR)
                deadline, drained = time.monotonic() + 1.0, 0
                while time.monotonic() < deadline and drained < REFUSAL_DRAIN_BYTES:
                    chunk = request.recv(65536)
                    if not chunk:
                        break
                    drained += len(chunk)
            self.shutdown_request(request)
        finally:
            self.refusing.release()

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._served(-1)
            self.slots.release()


class BadRequest(ValueError):
    pass


def make_server(
    retriever: Retriever, host: str, port: int, top_k_default: int, limits: Limits | None = None
) -> BoundedServer:
    """A bound server (port 0 = any free port: read it from `server.server_address`);
    call `serve_forever()` to answer."""
    lock = threading.Lock()
    caps = limits or Limits()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = SOCKET_TIMEOUT_S  # socket.settimeout on every connection

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/health":
                self._reply(200, {"status": "ok", "retriever": repr(retriever)})
            else:
                self._reply(404, {"error": f"no such path {self.path!r}; try POST /retrieve"})

        def do_POST(self) -> None:
            if self.path.rstrip("/") != "/retrieve":
                self._reply(404, {"error": f"no such path {self.path!r}; try POST /retrieve"})
                return
            try:
                queries, top_k, with_scores = _parse(self._body(), top_k_default, caps)
            except BadRequest as exc:
                self._reply(400, {"error": str(exc)})
                return
            try:
                with lock:
                    results = retriever.search(queries, top_k)
            except Exception as exc:
                log.exception("search of %d queries failed", len(queries))
                self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
                return
            self._reply(200, {"result": [_render(hits, with_scores) for hits in results]})

        def _body(self) -> bytes:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                raise BadRequest("a Content-Length header is required") from None
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True
                raise BadRequest(f"body of {length} bytes (at most {MAX_BODY_BYTES})")
            return self.rfile.read(length)

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return BoundedServer((host, port), Handler, caps.max_connections)


def _parse(body: bytes, top_k_default: int, limits: Limits) -> tuple[list[str], int, bool]:
    try:
        request = json.loads(body)
    except ValueError as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(request, dict):
        raise BadRequest("body must be a JSON object with 'queries'")
    queries = request.get("queries")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest("'queries' must be a list of strings")
    if len(queries) > limits.max_queries:
        raise BadRequest(f"{len(queries)} queries in one request, at most {limits.max_queries}")
    if any(len(q) > MAX_QUERY_CHARS for q in queries):
        raise BadRequest(f"a query is longer than {MAX_QUERY_CHARS} characters")
    top_k = request.get("topk") or top_k_default
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= limits.max_topk:
        raise BadRequest(
            f"'topk' must be an integer in 1..{limits.max_topk}, got {str(top_k)[:40]}"
        )
    with_scores = request.get("return_scores", False)
    if not isinstance(with_scores, bool):
        raise BadRequest(f"'return_scores' must be true or false, got {with_scores!r}")
    return queries, top_k, with_scores


def _render(hits: list[Passage], with_scores: bool) -> list[dict[str, Any]]:
    docs = [
        {"id": p.id, "contents": format_contents(p.title, p.text), "title": p.title, "text": p.text}
        for p in hits
    ]
    if not with_scores:
        return docs
    return [{"document": d, "score": p.score} for d, p in zip(docs, hits, strict=True)]


def serve(
    retriever: Retriever, host: str, port: int, top_k_default: int, limits: Limits | None = None
) -> None:
    """Answer until SIGTERM or SIGINT, then stop accepting, close the retriever and return.
    Prints the URL on stdout once it accepts connections."""
    server = make_server(retriever, host, port, top_k_default, limits)
    bound_host, bound_port = server.server_address[:2]
    url = f"http://{bound_host!s}:{bound_port}"
    stop = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)
    }
    thread = threading.Thread(target=server.serve_forever, name="retriever-http", daemon=True)
    thread.start()
    try:
        log.info("serving %r at %s (POST /retrieve, GET /health)", retriever, url)
        print(url, flush=True)
        while not stop.wait(1.0) and thread.is_alive():
            pass
    finally:
        server.shutdown()
        server.server_close()
        retriever.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("retriever at %s stopped", url)


def run_retriever(
    cfg: DrmasConfig, prepare: Callable[[DrmasConfig], DrmasConfig] | None = None
) -> int:
    """The `drmas retriever` role: the corpus, build (or load) the index, serve.

    `prepare` is the team's (what `drmas train` runs before it starts a process): the
    corpus is retriever.corpus_path in the config it returns, so a team that brings its
    own corpus (the search team for task.name=kb) sets it there; its errors are reported
    like the retriever's own."""
    from drmas.retrieval import build_retriever, resolve_corpus_path
    from drmas.transports.security import SecurityError

    rc = cfg.retriever
    try:
        check_bind(rc.host, rc.allow_remote)
    except SecurityError as exc:
        print(f"drmas retriever: {exc}", file=sys.stderr)
        return 2
    if rc.name not in ("bm25", "dense"):
        print(
            f"drmas retriever: retriever.name={rc.name} cannot be served; set "
            "retriever.name=bm25 or retriever.name=dense (http is the client of a server)",
            file=sys.stderr,
        )
        return 2
    try:
        prepared = prepare(cfg) if prepare is not None else cfg
        corpus = resolve_corpus_path(prepared.retriever)
        retriever = build_retriever(rc, corpus)
    except (FileNotFoundError, ValueError, ImportError) as exc:  # CorpusError is a ValueError
        print(f"drmas retriever: {exc}", file=sys.stderr)
        return 2
    try:
        serve(retriever, rc.host, rc.port, rc.top_k,
              Limits(rc.max_topk, rc.max_queries, rc.max_connections))  # fmt: skip
    except OSError as exc:  # the port is taken, or the host is not this machine's
        print(
            f"drmas retriever: cannot listen on {rc.host}:{rc.port} ({exc}); set "
            "retriever.host / retriever.port",
            file=sys.stderr,
        )
        retriever.close()
        return 2
    return 0
