"""An actor the broker dropped says Hello again once, however many of its messages the
broker refused meanwhile.

Seen in a loaded CI run: an actor stuck in a weight roll call was dropped for missed
publishes; its next lease request was refused (one Hello), and the refusals of its
heartbeats, still in its inbox, made a second Hello, which re-registered it and ended what
the first had been given."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from drmas.actors.main import Actor, is_unknown_client
from drmas.broker.server import BrokerServer
from drmas.protocol.messages import Heartbeat, Shutdown
from tests.fixtures.broker_server import serving_broker


@pytest.fixture
def serving(tmp_path: Path) -> Iterator[BrokerServer]:
    """A broker loop in a thread that drops an actor silent for one second."""
    with serving_broker(
        tmp_path, "broker.heartbeat_timeout_s=1", "broker.heartbeat_interval_s=0.2"
    ) as srv:
        yield srv


def wait_until(check: object, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def refused_heartbeats(serving: BrokerServer, actor: Actor) -> None:
    """Wait until the broker has dropped the silent actor, then send what a blocked actor
    sends meanwhile: heartbeats, each refused as from an unknown client."""
    wait_until(lambda: actor.id not in serving.state.table.actors, "the actor was never dropped")
    refused = serving.state.counters["refused/unknown_client"]
    for _ in range(3):
        actor.client.send(Heartbeat(actor.id, actor.versions()))
    wait_until(lambda: serving.state.counters["refused/unknown_client"] >= refused + 3,
               "the heartbeats were not refused")  # fmt: skip
    wait_until(lambda: actor.client.sock.poll(0), "no refusal came back")


def test_a_dropped_actor_says_hello_once_and_keeps_a_shutdown(serving: BrokerServer) -> None:
    cfg = dataclasses.replace(
        serving.cfg, broker=dataclasses.replace(serving.cfg.broker, address=serving.address)
    )
    actor = Actor(cfg, "slow-actor")
    counters = serving.state.counters
    try:
        actor.client.hello("actor", actor.models, timeout_s=20)
        assert counters["actors_joined"] == 1

        # dropped; its next lease request is refused: it says Hello again (once)
        refused_heartbeats(serving, actor)
        assert asyncio.run(actor.ask_for_leases(1)) == 1.0
        assert counters["actors_joined"] == 2
        assert not any(is_unknown_client(m) for m in actor.client.inbox)
        actor.drain_inbox()  # the heartbeats' refusals came before that Hello: no second one
        assert counters["actors_joined"] == 2 and counters["actors_re_registered"] == 0
        assert actor.id in serving.state.table.actors

        # dropped again, and the run ends meanwhile: one Hello, and the Shutdown is kept
        refused_heartbeats(serving, actor)
        actor.client.inbox.append(Shutdown("the run is over"))
        actor.drain_inbox()
        actor.drain_inbox()
        assert counters["actors_joined"] == 3 and counters["actors_re_registered"] == 0
        assert actor.stopping == "broker: the run is over"
    finally:
        actor.client.close()


def test_an_actor_welcomed_under_a_new_name_speaks_under_it(tmp_path: Path) -> None:
    """Its connection replaced while its registration is still fresh (the broker shut it
    at a host's cap, say), the actor is unknown on the new one, says Hello again and is
    welcomed as `<name>~<n>` (the old registration still holds its name). It must then
    speak as that: under its old name every message was refused and it said Hello again
    without end (seen in a whole run beside 256 idle actor connections)."""
    with serving_broker(tmp_path, "broker.heartbeat_timeout_s=30") as serving:
        cfg = dataclasses.replace(
            serving.cfg, broker=dataclasses.replace(serving.cfg.broker, address=serving.address)
        )
        actor = Actor(cfg, "moved-actor")
        counters = serving.state.counters
        try:
            actor.client.hello("actor", actor.models, timeout_s=20)
            actor.id = actor.client.client_id
            actor.client.sock.disconnect(serving.address)  # a new connection, a new routing id
            actor.client.sock.connect(serving.address)
            assert asyncio.run(actor.ask_for_leases(1)) == 1.0  # unknown there: Hello again
            assert actor.id == actor.client.client_id != "moved-actor"  # moved-actor~<n>
            refused = sum(v for k, v in counters.items() if k.startswith("refused/"))
            seen = serving.state.table.actors[actor.id].last_seen
            actor.client.send(Heartbeat(actor.id, actor.versions()))  # heard, as itself
            wait_until(lambda: serving.state.table.actors[actor.id].last_seen > seen, "unheard")
            assert sum(v for k, v in counters.items() if k.startswith("refused/")) == refused
            assert counters["actors_joined"] == 2 and actor.id in serving.state.table.actors
        finally:
            actor.client.close()
