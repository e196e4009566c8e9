"""The program endpoint over HTTP (workflow.endpoint=http, drmas/teams/program/server.py):
a real hypercorn server on loopback, the real openai client, raw sockets for the clients
that misbehave. An episode's calls arrive at its own path with the run's bearer token;
a stranger without it, a slow head, a slow or oversized body and hundreds of idle
connections cost a bounded amount and never keep an honest request from its answer."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from drmas.teams.program import server as server_module
from drmas.teams.program.chat import ChatCall, completion
from drmas.teams.program.endpoint import ChatEndpoint
from drmas.teams.program.server import EndpointServer, endpoint_token
from tests.fixtures.engines import CharTokenizer, ScriptedEngine
from tests.unit.test_program_team import TASK, config, team_of

TWO_CALLS = """
async def episode(client, task):
    assert "/episodes/" in str(client.base_url)  # what a subprocess would be handed
    a = await client.chat.completions.create(model="writer", messages=[{"role": "user", "content": "x"}])
    b = await client.chat.completions.create(model="critic", messages=[{"role": "user", "content": "y"}])
    return float(a.choices[0].message.content == "7" and b.choices[0].message.content == "ok")
"""


def test_a_program_reaches_its_episode_over_http_with_the_runs_token(tmp_path: Path) -> None:
    cfg = config(tmp_path, TWO_CALLS, "workflow.endpoint=http", f"run.dir={tmp_path / 'run'}")
    engine = ScriptedEngine(
        {"writer": ["7", "7"], "critic": ["ok", "ok"]},
        CharTokenizer(),
        lambda p: "writer" if p.endswith("User: x\nAssistant:") else "critic",
    )
    team = team_of(cfg, engine)

    async def main() -> list[Any]:
        from drmas.broker.sampling import lease_sampling

        try:
            return await team.run_group(TASK, lease_sampling(cfg, validation=False), 2)
        finally:
            await team.close()

    episodes = asyncio.run(main())
    assert [e.reward for e in episodes] == [1.0, 1.0]
    assert [[s.agent for s in e.steps] for e in episodes] == [["writer", "critic"]] * 2
    secret = tmp_path / "run" / "endpoint.secret"
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600


class Server:
    """An EndpointServer on a free loopback port with one episode, "e1", whose calls are
    answered at once; run in its own event loop thread by `serving`."""

    def __init__(self, tmp_path: Path) -> None:
        self.token = endpoint_token(str(tmp_path))
        self.server = EndpointServer("127.0.0.1", 0, self.token)

    async def start(self) -> None:
        async def answer(call: ChatCall) -> dict[str, Any]:
            return completion(call.agent, "hi", "stop", 1, 1, None)

        await self.server.start()
        self.server.router.episodes["e1"] = ChatEndpoint(
            ["writer"], answer, self.token, body_deadline_s=1.0
        )


def request(port: int, token: str, path: str = "/episodes/e1/v1/chat/completions") -> bytes:
    body = b'{"model": "writer", "messages": [{"role": "user", "content": "x"}]}'
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode() + body)
        return read_all(s)


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


@pytest.fixture
def live(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The server in a background event loop; yields (port, token)."""
    import threading

    monkeypatch.setattr(server_module, "KEEP_ALIVE_S", 1.0)
    loop = asyncio.new_event_loop()
    srv = Server(tmp_path)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield srv.server.port, srv.token
    asyncio.run_coroutine_threadsafe(srv.server.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)


def test_the_token_and_the_episode_are_checked(live) -> None:
    port, token = live
    assert status(request(port, token)) == 200
    assert status(request(port, "wrong")) == 401
    assert status(request(port, token, "/episodes/e2/v1/chat/completions")) == 404
    assert status(request(port, token, "/v1/chat/completions")) == 404


def test_a_slow_head_is_cut_off_and_honest_requests_go_on(live) -> None:
    """A head trickled a byte at a time is closed at the keep-alive deadline (1 s here):
    the server hangs up while the client still has bytes to send."""
    port, token = live
    head = (
        b"POST /episodes/e1/v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 600
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        cut = False
        for byte in head:
            try:
                s.sendall(bytes([byte]))
            except OSError:
                cut = True
                break
            assert status(request(port, token)) == 200  # honest requests meanwhile
            s.settimeout(0.05)
            try:
                if s.recv(1) == b"":
                    cut = True
                    break
            except TimeoutError:
                pass
            s.settimeout(30)
        assert cut, "the server read a whole slow head without closing the connection"


def test_an_oversized_body_is_refused_before_it_is_read(live) -> None:
    port, token = live
    head = (
        "POST /episodes/e1/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {1 << 30}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head)
        sent, reply = 0, b""
        s.settimeout(0.05)
        while sent < 64 << 20:  # a 1 GiB body: the answer comes after about 4 MiB
            try:
                s.sendall(b"x" * (1 << 20))
                sent += 1 << 20
                reply += s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if reply:
                break
        s.settimeout(30)
        with contextlib.suppress(OSError):
            reply += read_all(s)
    assert status(reply) == 413 and sent < 64 << 20


def test_a_slow_body_gets_408_and_idle_connections_do_not_starve_anyone(live) -> None:
    port, token = live
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(300)]
    try:
        assert status(request(port, token)) == 200  # beside 300 idle connections
        head = (
            "POST /episodes/e1/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {token}\r\nContent-Length: 1000\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(head + b"{")
            s.settimeout(30)
            assert status(read_all(s) or b"HTTP/1.1 000 x") == 408  # its deadline: 1 s here
    finally:
        for s in idle:
            s.close()
