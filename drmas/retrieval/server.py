"""`drmas retriever`: a bm25 or dense index served over HTTP in Search-R1's API, so many
actors (on many nodes) share one index instead of each loading its own.

    POST /retrieve  {"queries": [...], "topk": k, "return_scores": bool}  -> {"result": [...]}
    GET  /health    -> {"status": "ok", "retriever": "..."}

One thread per connection (stdlib ThreadingHTTPServer), at most `max_connections` at once:
beyond that a new connection takes the place of the one that has waited longest for its
request's head, once that one has waited EVICT_AFTER_S (slow-header and idle connections
cannot hold every slot), and is otherwise answered 503 and closed. What a connection may send and for how long is
bounded before it is read (drmas/retrieval/intake.py): the whole request must arrive
within `request_timeout_s` (a client trickling bytes is dropped like a silent one, and so
is an idle keep-alive connection; one whose body stops short is answered 408), its answer must be read within as long again, its
headers are capped, its body is refused from its Content-Length (413) over
`max_body_bytes`, and large bodies are read one at a time (BodyGate). The index is not
known to be thread-safe, so the searches themselves run one request at a time under a
lock (an actor already sends a turn's queries as one batch). Every malformed request
(not JSON, too deep, wrong types, topk over `max_topk`, more than `max_queries` queries
or one longer than MAX_QUERY_CHARS) gets 400 with {"error": ...}; a failing search 500.
There is no authentication: like the broker, it binds only loopback unless told otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from drmas.retrieval.handler import Handler, Service, raw_answer
from drmas.retrieval.intake import MAX_QUERY_CHARS, BadRequest, Limits

if TYPE_CHECKING:
    from drmas.config import DrmasConfig
    from drmas.retrieval import Retriever

__all__ = ["MAX_QUERY_CHARS", "BadRequest", "BoundedServer", "Limits", "make_server", "serve"]

log = logging.getLogger("drmas.retrieval")

REFUSERS = 8
"""Connections over the cap answered 503 at once (each by a thread for at most ~2 s); more
than that are closed unanswered."""
EVICT_AFTER_S = 0.05
"""At the connection cap, a connection that has waited this long for its request's head
(a slow or idle one: an honest client sends its head at once) is shut to make room for a
new one, the longest-waiting first. So every new connection gets a slot while any slot
waits for a head, and a client that reopens slow connections as they are shut only
evicts its own: a newcomer is the youngest, never the one evicted next."""
REFUSAL_DRAIN_BYTES = 1 << 20
"""Request bytes read from a refused connection before it is closed anyway."""


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

    def __init__(self, address: tuple[str, int], service: Service) -> None:
        super().__init__(address, Handler)
        self.service = service
        """What its connections serve (Handler reads it)."""
        self.slots = threading.BoundedSemaphore(service.limits.max_connections)
        self.refusing = threading.BoundedSemaphore(REFUSERS)
        self.refused = 0
        self.evicted = 0
        self._handed_over: set[Any] = set()  # evicted connections whose slot was passed on
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
            if self.service.heads.evict(EVICT_AFTER_S, self._hand_over):
                self._served(+1)  # the newcomer has the slot the evicted one leaves
                super().process_request(request, client_address)
                return
            self.refused += 1
            if self.refusing.acquire(blocking=False):  # answered 503 off the accept loop
                threading.Thread(target=self._refuse, args=(request,), daemon=True).start()
            else:  # a flood: beyond REFUSERS at once, closed without an answer
                self.shutdown_request(request)
            return
        self._served(+1)
        super().process_request(request, client_address)

    def _hand_over(self, evicted: Any) -> None:
        """`evicted`'s slot goes to the connection that evicts it: its thread must not
        release it (marked before the eviction shuts it, so before that thread can end)."""
        with self._count:
            self._handed_over.add(evicted)
            self.evicted += 1

    def _refuse(self, request: Any) -> None:
        """503, then read what the client is still sending before closing: closing a socket
        with unread data resets the connection, and the client would see a broken pipe
        instead of the answer."""
        try:
            with contextlib.suppress(OSError):
                request.settimeout(1.0)
                request.sendall(
                    raw_answer(b"503 Service Unavailable", "too many connections; retry later")
                )
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
            with self._count:
                handed_over = request in self._handed_over
                self._handed_over.discard(request)
            if not handed_over:  # an evicted connection's slot went to its evictor
                self.slots.release()
            self._served(-1)  # after the release: `serving` never counts a free slot as held

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up or resets is its own business (logged at debug, so a
        client cannot flood the log with tracebacks); anything else is logged in full."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("connection from %s dropped: %r", client_address, error)
        else:
            log.exception("serving %s failed", client_address)


def make_server(
    retriever: Retriever, host: str, port: int, top_k_default: int, limits: Limits | None = None
) -> BoundedServer:
    """A bound server (port 0 = any free port: read it from `server.server_address`);
    call `serve_forever()` to answer."""
    return BoundedServer((host, port), Service(retriever, top_k_default, limits or Limits()))


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
        limits = Limits(rc.max_topk, rc.max_queries, rc.max_connections,
                        rc.request_timeout_s, rc.max_body_bytes)  # fmt: skip
        serve(retriever, rc.host, rc.port, rc.top_k, limits)
    except OSError as exc:  # the port is taken, or the host is not this machine's
        print(
            f"drmas retriever: cannot listen on {rc.host}:{rc.port} ({exc}); set "
            "retriever.host / retriever.port",
            file=sys.stderr,
        )
        retriever.close()
        return 2
    return 0
