"""The actor's main loop against a scripted broker (a real ROUTER socket in this test):
what it does when the broker says Shutdown and then goes away."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import zmq

from drmas.actors import main as actor_main
from drmas.actors.engines import make_engine
from drmas.actors.main import Actor
from drmas.config import load_config
from drmas.protocol import decode_to_broker, encode
from drmas.protocol.messages import Goodbye, Hello, LeaseRequest, Leases, Shutdown, Welcome
from tests.fixtures.engines import InPlace


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


def run_against(script, args: tuple, timeout: float) -> Actor:  # type: ignore[no-untyped-def]
    """Run a sim-engine actor until it stops, against `script(router, *args)` on a real
    ROUTER socket in a thread."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    broker = threading.Thread(target=script, args=(router, *args), daemon=True)
    broker.start()
    cfg = load_config(
        [f"broker.address=tcp://127.0.0.1:{port}", "actor.engine.name=sim", "actor.max_groups=1"]
    )
    actor = Actor(cfg, "a1")
    try:
        asyncio.run(asyncio.wait_for(actor.run(), timeout=timeout))
    finally:
        broker.join(timeout=timeout + 5)
        router.close(linger=0)
    return actor


def test_shutdown_read_between_requests_stops_without_asking_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Shutdown read at the top of the loop ends it: the actor must not send another
    request to a broker that may already be gone (it used to, then waited out the request
    timeout and exited with BrokerUnavailable, code 1, instead of stopping cleanly)."""
    monkeypatch.setattr(actor_main, "REQUEST_TIMEOUT_S", 3.0)
    # sim engines with the builtin character tokenizer: no model folder to build
    monkeypatch.setattr(actor_main, "make_engine", lambda m, _p, c: make_engine(m, "", c))
    seen: list[str] = []
    actor = run_against(scripted_broker, (seen,), timeout=20)
    assert actor.stopping == "broker: training finished"
    assert seen.count("LeaseRequest") == 1, seen  # nothing asked after the Shutdown
    assert seen[-1] == "Goodbye", seen


@pytest.mark.parametrize("rolls_back", [True, False])
def test_a_load_that_fails_half_way_never_leaves_half_loaded_weights_serving(
    monkeypatch: pytest.MonkeyPatch, rolls_back: bool
) -> None:
    import time

    import torch

    from drmas.actors.engines import RollsBack
    from drmas.protocol.messages import JoinWeightGroup, LeaseReturn, WeightsLoaded
    from drmas.transports.weights import WeightSyncError

    cfg = load_config(["actor.engine.name=sim", "weights.verify_digest=false"])
    actor = Actor(cfg, "a1")
    sent: list[object] = []
    monkeypatch.setattr(actor.client, "send", sent.append)

    def half_then_fail(join: JoinWeightGroup, load, *_) -> None:  # type: ignore[no-untyped-def]
        load([("w", torch.ones(3))])  # the first bucket lands, then the learner dies
        raise WeightSyncError("peer gone")

    monkeypatch.setattr(actor.receiver, "receive_into", half_then_fail)

    async def main() -> None:
        engine = make_engine("solver", "", cfg.actor.engine_of("solver"))
        await engine.start()
        engine.load_weights([("w", torch.zeros(3))], 1)  # serving v1
        before = engine.weights_digest()
        actor.engines = {"solver": engine if rolls_back else InPlace(engine)}  # type: ignore[dict-item]
        assert isinstance(actor.engines["solver"], RollsBack) == rolls_back
        actor.running[7] = asyncio.create_task(asyncio.sleep(60))
        actor.leases[7] = None  # type: ignore[assignment]
        actor.started_at[7] = 0.0
        actor.joins.append((JoinWeightGroup("solver", 2, "g", "h:1", 1, 2, 5.0), time.monotonic()))
        await actor.sync_weights()
        loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
        assert len(loaded) == 1 and not loaded[0].ok
        if rolls_back:  # the previous version serves, bit for bit
            assert engine.version == 1 and engine.weights_digest() == before
            assert "restored" in loaded[0].error and 7 in actor.running
        else:  # cannot undo: no group generates on it, none is asked for until a reload
            assert actor.quarantined == {"solver": 1} and engine.version == 1  # re-published
            assert not actor.running
            assert any(isinstance(m, LeaseReturn) and m.lease_ids == [7] for m in sent)
        for task in actor.running.values():
            task.cancel()
        await engine.close()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


@pytest.mark.parametrize("rolls_back", [True, False])
def test_the_engine_generates_on_until_the_first_bucket_and_a_publish_failing_before_it_costs_nothing(
    monkeypatch: pytest.MonkeyPatch, rolls_back: bool
) -> None:
    """The roll call and the rendezvous may wait for other members (and fail when one
    checks in and never joins): the engine is paused only once the first bucket is in.
    A publish that fails before that leaves the engine serving, its leases running and
    nothing restored or quarantined (an engine that cannot roll back used to be
    quarantined, its leases handed back, for a group it never received a byte of)."""
    import threading
    import time

    import torch

    from drmas.protocol.messages import JoinWeightGroup, LeaseReturn, WeightsLoaded
    from drmas.transports.weights import ReceiveStats, WeightSyncError

    cfg = load_config(["actor.engine.name=sim", "weights.verify_digest=false"])
    actor = Actor(cfg, "a1")
    sent: list[object] = []
    monkeypatch.setattr(actor.client, "send", sent.append)
    paused_at_first_bucket: list[bool] = []
    rendezvous = threading.Event()  # set by the test while the receive waits in it

    def fails_in_the_rendezvous(join: JoinWeightGroup, load, *_) -> ReceiveStats:  # type: ignore[no-untyped-def]
        rendezvous.wait(10)
        raise WeightSyncError("a member checked in and never joined")

    def loads(join: JoinWeightGroup, load, *_) -> ReceiveStats:  # type: ignore[no-untyped-def]
        paused_at_first_bucket.append(engine.paused)
        load([("w", torch.full((3,), 2.0))])
        paused_at_first_bucket.append(engine.paused)
        return ReceiveStats(0.0, 12, 1, 1)

    async def main() -> None:
        nonlocal engine
        engine = make_engine("solver", "", cfg.actor.engine_of("solver"))
        await engine.start()
        engine.load_weights([("w", torch.zeros(3))], 1)
        pause, resume = engine.pause, engine.resume

        async def pausing() -> None:
            await pause()
            engine.paused = True

        async def resuming() -> None:
            await resume()
            engine.paused = False

        engine.paused = False
        monkeypatch.setattr(engine, "pause", pausing)
        monkeypatch.setattr(engine, "resume", resuming)
        actor.engines = {"solver": engine if rolls_back else InPlace(engine)}  # type: ignore[dict-item]
        actor.running[7] = asyncio.create_task(asyncio.sleep(60))
        actor.leases[7] = None  # type: ignore[assignment]
        actor.started_at[7] = 0.0
        monkeypatch.setattr(actor.receiver, "receive_into", fails_in_the_rendezvous)
        actor.joins.append((JoinWeightGroup("solver", 2, "g", "h:1", 1, 2, 5.0), time.monotonic()))
        syncing = asyncio.create_task(actor.sync_weights())
        await asyncio.sleep(0.2)
        assert not engine.paused  # generating while the receive waits in the rendezvous
        rendezvous.set()
        await syncing
        loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
        assert len(loaded) == 1 and not loaded[0].ok and "nothing loaded" in loaded[0].error
        assert engine.version == 1 and not actor.quarantined and 7 in actor.running
        assert not any(isinstance(m, LeaseReturn) for m in sent) and not engine.paused
        monkeypatch.setattr(actor.receiver, "receive_into", loads)
        actor.joins.append((JoinWeightGroup("solver", 3, "g", "h:1", 1, 2, 5.0), time.monotonic()))
        await actor.sync_weights()
        assert paused_at_first_bucket == [False, True] and not engine.paused
        assert engine.version == 3 and sent[-1].ok  # type: ignore[attr-defined]
        actor.running.pop(7).cancel()
        await engine.close()

    engine: Any = None
    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_shutdown_read_between_two_loads_ends_them_and_nothing_more_is_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Shutdown read while weight joins are queued: the joins after it are not loaded
    (their learners may be gone: each would wait out its store's timeout) and no request is
    sent after it (a GroupResult and a LeaseRequest each used to wait 30 s for a broker
    that had exited, so an attached actor outlived the run by a minute)."""
    from drmas.protocol.messages import JoinWeightGroup, LeaseRequest, Shutdown, WeightsLoaded
    from drmas.transports.channel import BrokerUnavailable
    from drmas.transports.weights import ReceiveStats

    cfg = load_config(["actor.engine.name=sim", "weights.verify_digest=false"])
    actor = Actor(cfg, "a1")
    sent: list[object] = []
    monkeypatch.setattr(actor.client, "send", sent.append)
    arriving: list[list[object]] = [[], [Shutdown("training finished")]]  # one list a drain
    drains: list[object] = []

    def recv(timeout_s: float = 0) -> object:
        if not drains and arriving:
            drains.extend([*arriving.pop(0), None])
        return drains.pop(0) if drains else None

    monkeypatch.setattr(actor.client, "recv", recv)
    loaded: list[str] = []
    monkeypatch.setattr(
        actor.receiver,
        "receive_into",
        lambda join, load, *_: loaded.append(join.model) or ReceiveStats(0.0, 0, 0, 0),
    )

    async def main() -> None:
        engines = {m: make_engine(m, "", cfg.actor.engine_of(m)) for m in ("solver", "verifier")}
        for engine in engines.values():
            await engine.start()
        actor.engines = engines  # type: ignore[assignment]
        for model in engines:
            actor.joins.append(
                (JoinWeightGroup(model, 2, model, "h:1", 1, 2, 5.0), time.monotonic())
            )
        await actor.sync_weights()
        assert loaded == ["solver"] and actor.stopping == "broker: training finished"
        with pytest.raises(BrokerUnavailable, match="said Shutdown"):
            await actor.ask(LeaseRequest(actor.id, 1, actor.versions()), object)  # type: ignore[arg-type]
        assert [type(m) for m in sent] == [WeightsLoaded]  # nothing sent after the Shutdown
        for engine in engines.values():
            await engine.close()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_a_publish_of_no_tensor_moves_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a LoRA base a publish carries only the adapters that changed, possibly none: the
    receiver then calls no load at all, yet the engine must report the new version, or the
    broker would see the actor behind and re-publish (nothing) forever."""
    import time

    from drmas.protocol.messages import JoinWeightGroup, WeightsLoaded
    from drmas.transports.weights import ReceiveStats

    cfg = load_config(["actor.engine.name=sim", "weights.verify_digest=false"])
    actor = Actor(cfg, "a1")
    sent: list[object] = []
    monkeypatch.setattr(actor.client, "send", sent.append)
    monkeypatch.setattr(
        actor.receiver, "receive_into", lambda join, load, *_: ReceiveStats(0.0, 0, 0, 0)
    )

    async def main() -> None:
        engine = make_engine("solver", "", cfg.actor.engine_of("solver"))
        await engine.start()
        actor.engines = {"solver": engine}
        actor.joins.append((JoinWeightGroup("solver", 3, "g", "h:1", 1, 2, 5.0), time.monotonic()))
        await actor.sync_weights()
        loaded = [m for m in sent if isinstance(m, WeightsLoaded)]
        assert len(loaded) == 1 and loaded[0].ok and loaded[0].version == 3
        assert engine.version == 3 and actor.versions() == {"solver": 3}
        await engine.close()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def slow_broker(sock: zmq.Socket, seen: list[tuple[float, str]], stall_s: float) -> None:
    """Welcome; leave the first LeaseRequest unanswered for `stall_s` (a broker stalled in
    a long operation), answer the retried one with no leases, then Shutdown. Records
    (time, tag) of everything received."""
    stalled_until = None
    identity = b""
    while True:
        if not sock.poll(100):
            if stalled_until is not None and time.monotonic() >= stalled_until:
                sock.send_multipart([identity, encode(Shutdown("done"))])
                stalled_until = None
            if seen and seen[-1][1] == "Goodbye":
                return
            continue
        identity, payload = sock.recv_multipart()
        msg = decode_to_broker(payload)
        seen.append((time.monotonic(), type(msg).__name__))
        if isinstance(msg, Hello):
            sock.send_multipart([identity, encode(Welcome("run", {}, {}, 0.2))])
        elif isinstance(msg, LeaseRequest):
            if sum(t == "LeaseRequest" for _, t in seen) == 1:
                stalled_until = time.monotonic() + stall_s  # no answer to this one
            else:
                sock.send_multipart([identity, encode(Leases([], retry_after_s=5.0))])
        elif isinstance(msg, Goodbye):
            return


def test_heartbeats_go_on_while_a_request_waits_and_a_stall_is_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The actor used to block its event loop in a 30 s ZeroMQ poll: no heartbeat while it
    waited, and an unanswered request ended the actor at once."""
    monkeypatch.setattr(actor_main, "REQUEST_TIMEOUT_S", 1.5)
    monkeypatch.setattr(actor_main, "make_engine", lambda m, _p, c: make_engine(m, "", c))
    seen: list[tuple[float, str]] = []
    actor = run_against(slow_broker, (seen, 2.5), timeout=30)
    asks = [t for t, tag in seen if tag == "LeaseRequest"]
    assert len(asks) >= 2  # the unanswered one was retried, the actor did not exit
    beats = [t for t, tag in seen if tag == "Heartbeat" and asks[0] < t < asks[1]]
    assert len(beats) >= 4, seen  # every 0.2 s while the first request waited
    assert actor.stopping == "broker: done"
