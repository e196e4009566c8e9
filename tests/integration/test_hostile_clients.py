"""One real run beside the clients of issue #36 that used to stop or stall a run, from the
moment its broker answers: connections that hold the names of both learners and of an
actor as their ZeroMQ identity and say nothing (the learners' Hellos went unanswered and
the run died), an actor that says Hello and Goodbye at once, and one that keeps
heartbeating but never joins a weight publish (every publish waited the full timeout for
it). The run finishes every step; the fake is left out of each publish after
weights.join_timeout_s and dropped after three. (The seat squatter: test_learner_seats.py.)"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest
import zmq

from drmas.protocol import decode_from_broker, encode
from drmas.protocol.messages import Goodbye, Heartbeat, Welcome
from tests.integration.conftest import (
    actor_hello,
    broker_address,
    finish,
    read_summary,
    start_train,
)

pytestmark = pytest.mark.slow

MODELS = ["solver", "verifier"]
STEPS = 4  # FAST's train.steps


def dealer(ctx: zmq.Context, address: str, identity: bytes = b"") -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    if identity:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def ask(sock: zmq.Socket, msg: object, timeout_s: float = 60) -> object:
    sock.send(encode(msg))
    assert sock.poll(int(timeout_s * 1000)), f"no answer to {type(msg).__name__}"
    return decode_from_broker(sock.recv())


def fake_actor(sock: zmq.Socket, stop: threading.Event, seen: Counter[str]) -> None:
    """Heartbeats every second; reads what it is sent and never acts on it."""
    while not stop.wait(1.0):
        sock.send(encode(Heartbeat("fake-actor")))
        while sock.poll(0):
            seen[type(decode_from_broker(sock.recv())).__name__] += 1


def test_name_squatters_a_brief_actor_and_one_that_never_joins_do_not_stop_the_run(
    tmp_path: Path, model_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    train = start_train(run_dir, model_cache)  # weights.join_timeout_s: 5 s
    ctx = zmq.Context()
    stop, seen = threading.Event(), Counter[str]()
    thread = None
    try:
        address = broker_address(run_dir)
        names = [f"learner-{m}-0" for m in MODELS] + ["actor-0"]
        squatters = [dealer(ctx, address, name.encode()) for name in names]  # silent
        brief = dealer(ctx, address)
        assert isinstance(ask(brief, actor_hello(run_dir, "brief-actor", MODELS)), Welcome)
        brief.send(encode(Goodbye("brief-actor", [], "leaving at once")))
        fake = dealer(ctx, address)
        assert isinstance(ask(fake, actor_hello(run_dir, "fake-actor", MODELS)), Welcome)
        thread = threading.Thread(target=fake_actor, args=(fake, stop, seen), daemon=True)
        thread.start()
        out = finish(train, timeout=900)
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
        if train.poll() is None:
            train.terminate()
            train.wait(60)
        ctx.destroy(linger=0)
    assert len(squatters) == 3
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert summary["done"] and summary["versions"] == dict.fromkeys(MODELS, STEPS), (
        summary,
        out[-2000:],
    )
    assert c["actors_left"] >= 1, c  # the brief one
    assert seen["JoinWeightGroup"] >= 1, seen  # the fake was asked to join, and never did
    assert c["weight_joins_missed"] >= 3 and c["actors_never_joined"] == 1, c
    assert c.get("learners_lost", 0) == 0, c
