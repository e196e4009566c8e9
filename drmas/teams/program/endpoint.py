"""The OpenAI-compatible endpoint as a small ASGI app: `GET /v1/models` (one model per
agent) and `POST /v1/chat/completions` (one agent call).

Who talks to it: the program's `openai.AsyncOpenAI` client. In process (the default) the
client's httpx transport calls this app directly (`ASGITransport`: no socket, nothing to
bind); served over HTTP, an ASGI server runs the same app. The app only reads and checks
the request (chat.py) and hands a `ChatCall` to `complete`, which the program team
(team.py) implements: render, generate, record the step, answer.

Bounded: a body over `max_body_bytes` is refused with 413 before it is read further, one
slower than `body_deadline_s` with 408; a request without the bearer token (when one is
set) gets 401.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from drmas.teams.program.chat import ChatCall, ChatError, models, parse_chat

Complete = Callable[[ChatCall], Awaitable[dict[str, Any]]]
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

MAX_BODY_BYTES = 4 << 20
"""A chat request's body (4 MiB: far more than any context a trained model takes)."""


class ChatEndpoint:
    """The ASGI app: routes, the bearer token, the body limit; `complete` does the rest."""

    def __init__(
        self,
        agents: Sequence[str],
        complete: Complete,
        token: str = "",
        max_body_bytes: int = MAX_BODY_BYTES,
        body_deadline_s: float = 30.0,
    ) -> None:
        self.agents = list(agents)
        self.complete = complete
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.body_deadline_s = body_deadline_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        status, body = await self._answer(scope, receive)
        await respond(send, status, body)

    async def _answer(self, scope: Scope, receive: Receive) -> tuple[int, dict[str, Any]]:
        try:
            if self.token and bearer(scope) != self.token:
                raise ChatError(
                    401, "missing or wrong bearer token (the run folder's endpoint token)"
                )
            path = scope["path"].removeprefix("/v1")
            if path == "/models" and scope["method"] == "GET":
                return 200, models(self.agents)
            if path == "/chat/completions" and scope["method"] == "POST":
                call = parse_chat(await self._json(receive), self.agents)
                return 200, await self.complete(call)
            raise ChatError(404, f"no route {scope['method']} {scope['path']}: this endpoint "
                            "serves GET /v1/models and POST /v1/chat/completions")  # fmt: skip
        except ChatError as exc:
            return exc.status, exc.body()

    async def _json(self, receive: Receive) -> object:
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_deadline_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise ChatError(408, f"the body took over {self.body_deadline_s:g}s") from None
            if message["type"] == "http.disconnect":
                raise ChatError(400, "the client hung up before the body was complete")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise ChatError(413, f"request body over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        try:
            return json.loads(b"".join(chunks))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ChatError(400, f"the body is not JSON: {exc}") from None


async def respond(send: Send, status: int, body: dict[str, Any]) -> None:
    """One JSON response."""
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def bearer(scope: Scope) -> str:
    for name, value in scope.get("headers", []):
        if name.lower() == b"authorization":
            text = value.decode("latin-1")
            return text[7:] if text[:7].lower() == "bearer " else ""
    return ""


async def lifespan(receive: Receive, send: Send) -> None:
    """ASGI lifespan events: nothing to set up or tear down, acknowledged."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
