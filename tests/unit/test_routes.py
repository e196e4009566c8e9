"""Who a connection is (drmas/broker/routes.py; issue #36, item 2): the broker, not the
client, decides it. A connection that only holds a client's name, or asks for a name a live
connection speaks for, cannot cut that client off; a client that reconnects gets its name
back. On a real broker loop over loopback, and the pure map alone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from drmas.broker.routes import Routes
from drmas.broker.server import BrokerServer
from drmas.protocol import PROTOCOL_VERSION
from drmas.protocol.messages import (
    ErrorReply,
    Heartbeat,
    Hello,
    LeaseRequest,
    Leases,
    StatusReply,
    StatusRequest,
    Welcome,
)
from tests.fixtures.broker_server import broker_server
from tests.unit.test_broker_gate import Peer

MODELS = ["solver", "verifier"]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BrokerServer]:
    with broker_server(tmp_path, "broker.heartbeat_interval_s=0.2") as srv:
        yield srv


class Conn(Peer):
    """A DEALER as drmas's clients open it: no identity of its own, unless `identity`
    (test_broker_gate's Peer, which always sets one, pumps the broker the same way)."""

    def __init__(self, server: BrokerServer, identity: bytes = b"") -> None:
        self.server, self.cid = server, ""
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(server.address)

    def hello(self, name: str, role: str = "actor", **kw: Any) -> Any:  # type: ignore[override]
        models = kw.pop("models", MODELS if role == "actor" else [])
        return self.ask(Hello(role, name, PROTOCOL_VERSION, models, **kw))  # type: ignore[arg-type]


def test_a_connection_holding_a_clients_name_as_its_identity_cannot_cut_it_off(
    server: BrokerServer,
) -> None:
    """The issue's attack: a connection that holds the identity `learner-solver-0` and says
    nothing left the real learner's Hello unanswered (a ROUTER ignores a second connection
    with an identity in use). Now the broker names connections itself."""
    squatter = Conn(server, identity=b"learner-solver-0")
    # connected, and known to the ROUTER under that identity
    assert isinstance(squatter.ask(StatusRequest()), StatusReply)
    real = Conn(server)
    welcome = real.hello("learner-solver-0", "learner", models=["solver"])
    assert isinstance(welcome, Welcome) and welcome.client_id == "learner-solver-0"
    assert isinstance(real.ask(Heartbeat("learner-solver-0")), type(None))  # no reply, admitted
    assert server.state.learners["learner-solver-0"].last_seen > 0
    # what the squatter sends is not the learner's: it never said Hello
    reply = squatter.ask(LeaseRequest("learner-solver-0", 1, {}))
    assert isinstance(reply, ErrorReply) and reply.code == "unknown_client", reply
    for c in (squatter, real):
        c.close()


def test_a_second_connection_asking_for_a_live_actors_name_gets_another(
    server: BrokerServer,
) -> None:
    first, second = Conn(server), Conn(server)
    assert isinstance(first.hello("actor-0"), Welcome)
    welcome = second.hello("actor-0")
    assert isinstance(welcome, Welcome) and welcome.client_id == "actor-0~2", welcome
    assert set(server.state.table.actors) == {"actor-0", "actor-0~2"}
    # each connection still speaks for its own name
    assert isinstance(first.ask(LeaseRequest("actor-0", 1, {})), Leases)
    reply = second.ask(LeaseRequest("actor-0", 1, {}))  # the other's name: refused
    assert isinstance(reply, ErrorReply) and reply.code == "invalid", reply
    assert isinstance(second.ask(LeaseRequest("actor-0~2", 1, {})), Leases)
    for c in (first, second):
        c.close()


def test_a_client_that_reconnects_after_falling_silent_gets_its_name_back(
    server: BrokerServer,
) -> None:
    first = Conn(server)
    assert isinstance(first.hello("actor-7"), Welcome)
    first.close()  # its connection is gone; its record stays until the actor timeout
    stale = 3 * server.cfg.broker.heartbeat_interval_s
    time.sleep(stale + 0.1)  # silent past the routes' staleness: a restart, not a rival
    again = Conn(server)
    welcome = again.hello("actor-7")
    assert isinstance(welcome, Welcome) and welcome.client_id == "actor-7", welcome
    assert isinstance(again.ask(LeaseRequest("actor-7", 1, {})), Leases)
    again.close()


def test_an_observer_needs_no_hello_and_a_learner_name_is_not_renamed(
    server: BrokerServer,
) -> None:
    watch = Conn(server)
    assert isinstance(watch.ask(StatusRequest()), StatusReply)
    real, rival = Conn(server), Conn(server)
    assert isinstance(real.hello("L0", "learner", models=["solver"]), Welcome)
    reply = rival.hello("L0", "learner", models=["solver"])  # no secret here: nobody can tell
    assert isinstance(reply, ErrorReply) and reply.code == "forbidden", reply
    assert "in use by another live connection" in reply.reason
    for c in (watch, real, rival):
        c.close()


def test_routes_map_by_hand() -> None:
    r = Routes(stale_s=1.0)
    seen: dict[str, float] = {}
    assert r.claim("a", b"1", "", seen.get, 0.0, rename=True) == "a"
    r.bind("a", b"1", "")
    seen["a"] = 0.0
    assert r.claim("a", b"1", "", seen.get, 0.5, rename=True) == "a"  # the same connection
    assert r.claim("a", b"2", "", seen.get, 0.5, rename=True) == "a~2"  # a live rival
    assert r.claim("a", b"2", "", seen.get, 0.5, rename=False) == "a"  # a learner: the gate decides
    assert r.taken("a", b"2", "", seen["a"], 0.5)
    assert r.claim("a", b"2", "", seen.get, 2.0, rename=True) == "a"  # silent: a restart
    assert r.claim("a", b"2", "other-key", seen.get, 2.0, rename=True) == "a~2"  # not its key
    r.bind("a", b"2", "")
    assert r.name_of(b"1") is None and r.name_of(b"2") == "a" and r.identity_of("a") == b"2"
    r.bind("b", b"2", "")  # a connection speaks for one name: the one it said Hello as last
    assert r.identity_of("a") is None and r.name_of(b"2") == "b"
    r.prune(lambda name: name != "b")
    assert r.name_of(b"2") is None and not r.by_name
    r.bind("c", b"3", "")
    r.forget(b"3")  # a connection the broker shut: its client's name is free again
    assert (
        r.identity_of("c") is None
        and r.claim("c", b"4", "", {"c": 9.0}.get, 9.0, rename=True) == "c"
    )
