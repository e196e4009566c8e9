"""The actor's main loop against a scripted broker (a real ROUTER socket in this test):
what it does when the broker says Shutdown and then goes away."""

from __future__ import annotations

import asyncio
import threading

import pytest
import zmq

from drmas.actors import main as actor_main
from drmas.actors.engines import make_engine
from drmas.actors.main import Actor
from drmas.launch.config import load_config
from drmas.protocol import decode_to_broker, encode
from drmas.protocol.messages import Goodbye, Hello, LeaseRequest, Leases, Shutdown, Welcome


def scripted_broker(sock: zmq.Socket, seen: list[str]) -> None:
    """Welcome the actor; on its first LeaseRequest send Shutdown, then the answer (no
    leases, retry at once), so the actor holds the Shutdown in its inbox when the request
    returns; then answer nothing more (a broker that has exited). Records the tags it received until the actor's Goodbye."""
    while True:
        if not sock.poll(20_000):
            return
        identity, payload = sock.recv_multipart()
        msg = decode_to_broker(payload)
        seen.append(type(msg).__name__)
        if isinstance(msg, Hello):
            sock.send_multipart([identity, encode(Welcome("run", {}, {}, 60.0))])
        elif isinstance(msg, LeaseRequest) and seen.count("LeaseRequest") == 1:
            sock.send_multipart([identity, encode(Shutdown("training finished"))])
            sock.send_multipart([identity, encode(Leases([], retry_after_s=0.0))])
        elif isinstance(msg, Goodbye):
            return


def test_shutdown_read_between_requests_stops_without_asking_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Shutdown read at the top of the loop ends it: the actor must not send another
    request to a broker that may already be gone (it used to, then waited out the request
    timeout and exited with BrokerUnavailable, code 1, instead of stopping cleanly)."""
    monkeypatch.setattr(actor_main, "REQUEST_TIMEOUT_S", 3.0)
    # sim engines with the builtin character tokenizer: no model folder to build
    monkeypatch.setattr(actor_main, "make_engine", lambda m, _p, c: make_engine(m, "", c))
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    seen: list[str] = []
    broker = threading.Thread(target=scripted_broker, args=(router, seen), daemon=True)
    broker.start()
    cfg = load_config(
        [f"broker.address=tcp://127.0.0.1:{port}", "actor.engine.name=sim", "actor.max_groups=1"]
    )
    actor = Actor(cfg, "a1")
    try:
        asyncio.run(asyncio.wait_for(actor.run(), timeout=20))
    finally:
        broker.join(timeout=25)
        router.close(linger=0)
    assert actor.stopping == "broker: training finished"
    assert seen.count("LeaseRequest") == 1, seen  # nothing asked after the Shutdown
    assert seen[-1] == "Goodbye", seen
