"""Actors belong to the run (issue #47): an actor's Hello must prove, under the run's
actor secret, the client id it asks for, or it is refused before that id is routed, so a
client that holds neither of the run's secrets cannot lease tasks, hand in groups, hold a
name or answer a roll call. On a real broker loop on loopback (Peer), and through the real
BrokerClient an actor uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from drmas.broker.server import BrokerServer
from drmas.config.transport import SecurityConfig
from drmas.protocol.messages import ErrorReply, LeaseRequest, Welcome
from drmas.transports.channel import BrokerClient, BrokerRefused
from drmas.transports.learner_secret import (
    actor_proof,
    actor_proves,
    ensure_secret,
    load_actor_secret,
)
from drmas.transports.security import SecurityError
from tests.fixtures.broker_server import broker_server, serving_broker
from tests.unit.test_broker_gate import Peer

MODELS = ["solver", "verifier"]


@pytest.fixture
def actor_file(tmp_path: Path) -> Path:
    return ensure_secret(tmp_path / "run" / "actor.secret")


@pytest.fixture
def server(tmp_path: Path, actor_file: Path) -> Iterator[BrokerServer]:
    with broker_server(tmp_path, f"security.actor_secret={actor_file}") as srv:
        yield srv


def test_an_actor_proof_names_one_id_under_one_secret() -> None:
    a, b = b"a" * 64, b"b" * 64
    p = actor_proof(a, "actor-0")
    assert actor_proves(a, p, "actor-0")
    assert not actor_proves(b, p, "actor-0")
    assert not actor_proves(a, p, "actor-1")
    assert not actor_proves(a, "", "actor-0")


def test_an_actor_without_the_proof_is_refused_and_holds_nothing(
    server: BrokerServer, actor_file: Path
) -> None:
    secret = actor_file.read_text().strip().encode()
    stranger = Peer(server, "actor-9")
    # no proof, a made-up one, another actor's proof, a learner-secret-shaped one
    for given in ("", "0" * 64, actor_proof(secret, "actor-0"), actor_proof(b"x" * 64, "actor-9")):
        reply = stranger.hello("actor", MODELS, proof=given)
        assert isinstance(reply, ErrorReply) and reply.code == "forbidden", reply
        assert "did not prove it is an actor of this run" in reply.reason
        assert "RUN_DIR/actor.secret" in reply.reason
    reply = stranger.ask(LeaseRequest(client_id="actor-9", max_groups=4, versions={}))
    assert isinstance(reply, ErrorReply)  # never welcomed: no leases
    assert not server.state.table.actors and "actor-9" not in server.routes.by_name
    real = Peer(server, "actor-0")
    assert isinstance(real.hello("actor", MODELS, proof=actor_proof(secret, "actor-0")), Welcome)
    # observers need no proof: status is read-only
    assert isinstance(Peer(server, "watcher").hello("client", []), Welcome)
    for peer in (stranger, real):
        peer.close()


def test_the_actors_client_proves_itself_from_the_config(tmp_path: Path, actor_file: Path) -> None:
    with serving_broker(tmp_path, f"security.actor_secret={actor_file}") as srv:
        mine = SecurityConfig(actor_secret=str(actor_file))
        client = BrokerClient(srv.address, "actor-1", security=mine)
        try:
            assert isinstance(client.hello("actor", MODELS, timeout_s=20), Welcome)
        finally:
            client.close()
        other = tmp_path / "other.secret"
        ensure_secret(other)
        stranger = BrokerClient(
            srv.address, "actor-2", security=SecurityConfig(actor_secret=str(other))
        )
        try:
            with pytest.raises(BrokerRefused, match="did not prove it is an actor"):
                stranger.hello("actor", MODELS, timeout_s=20)
        finally:
            stranger.close()


def test_an_unreadable_actor_secret_says_where_to_copy_it(tmp_path: Path) -> None:
    assert load_actor_secret(SecurityConfig()) is None
    with pytest.raises(
        SecurityError, match="copy it to every node that runs the broker or an actor"
    ):
        load_actor_secret(SecurityConfig(actor_secret=str(tmp_path / "nowhere")))
