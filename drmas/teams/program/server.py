"""The program endpoint over HTTP (workflow.endpoint=http), for a program that hands the
endpoint to another process or language: one server per actor, on hypercorn (a maintained
ASGI server), serving every episode's ChatEndpoint under its own path:

    POST http://HOST:PORT/episodes/<episode id>/v1/chat/completions
    GET  http://HOST:PORT/episodes/<episode id>/v1/models
    Authorization: Bearer <RUN_DIR/endpoint.secret>

The program's `client` already points there (base_url, api_key); a subprocess can be given
`client.base_url` and `client.api_key`. Loopback only unless workflow.endpoint_host says
otherwise; port workflow.endpoint_port (0: a free one, logged).

Bounded (tests/unit/test_program_http.py): a connection that has not sent a whole request
head within KEEP_ALIVE_S is closed (hypercorn's idle deadline runs from the connection's
start until a request begins, whatever trickles in), a head over 16 KiB is refused, a body
over 4 MiB gets 413 before more is read and one slower than BODY_DEADLINE_S gets 408, and
at most MAX_REQUESTS requests run at once (503 beyond).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
from pathlib import Path
from typing import Any

from drmas.teams.program.chat import ChatError
from drmas.teams.program.endpoint import (
    ChatEndpoint,
    Receive,
    Scope,
    Send,
    bearer,
    lifespan,
    respond,
)

log = logging.getLogger("drmas.actor")

KEEP_ALIVE_S = 5.0
"""A connection's deadline for a whole request head (and an idle keep-alive's)."""
BODY_DEADLINE_S = 30.0
"""A request body's deadline, from its head."""
MAX_REQUESTS = 256
"""Requests served at once (a group's episodes call concurrently: G at a time per lease)."""
SECRET = "endpoint.secret"


def endpoint_token(run_dir: str) -> str:
    """RUN_DIR/endpoint.secret (made on first use, readable by its owner only)."""
    path = Path(run_dir) / SECRET
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
    return path.read_text().strip()


class Router:
    """The ASGI app: /episodes/<id>/... to that episode's ChatEndpoint, the token checked
    first, at most MAX_REQUESTS at once."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.episodes: dict[str, ChatEndpoint] = {}
        self.slots = asyncio.Semaphore(MAX_REQUESTS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if bearer(scope) != self.token:
            error = ChatError(401, f"missing or wrong bearer token (RUN_DIR/{SECRET})")
            await respond(send, error.status, error.body())
            return
        _, _, episode, rest = (
            (scope["path"] + "/").split("/", 3)
            if scope["path"].startswith("/episodes/")
            else ("", "", "", "")
        )
        endpoint = self.episodes.get(episode)
        if endpoint is None:
            error = ChatError(
                404, "no such episode: use the base_url the program's client was given"
            )
            await respond(send, error.status, error.body())
            return
        if self.slots.locked():
            error = ChatError(503, f"{MAX_REQUESTS} requests already running; retry")
            await respond(send, error.status, error.body())
            return
        async with self.slots:
            inner = {**scope, "path": "/" + rest.rstrip("/")}
            await endpoint(inner, receive, send)


class EndpointServer:
    """One actor's HTTP server, started at its first program episode, stopped with it."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self.router = Router(token)
        self.token = token
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from hypercorn.asyncio import serve
        from hypercorn.config import Config

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(512)
        self.port = sock.getsockname()[1]
        config = Config()
        config.keep_alive_timeout = KEEP_ALIVE_S
        config.h11_max_incomplete_size = 16384
        config.read_timeout = int(BODY_DEADLINE_S)
        config.accesslog = None
        config.errorlog = logging.getLogger("drmas.endpoint")
        config.bind = [f"fd://{sock.detach()}"]  # hypercorn owns the socket from here
        app: Any = self.router  # a plain ASGI callable; hypercorn's types name its own
        self._task = asyncio.create_task(serve(app, config, shutdown_trigger=self._stop.wait))
        log.info(
            "program endpoint on http://%s:%d (bearer token in %s)", self.host, self.port, SECRET
        )

    def base_url(self, episode: str) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/episodes/{episode}/v1"

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, 10)
