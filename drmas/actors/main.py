"""The actor process: runs leased groups through the workflow and streams them back.

Talks to the broker only (DEALER, drmas/transports/channel.py):
  -> Hello, LeaseRequest, GroupResult, Heartbeat, WeightsLoaded, Goodbye
  <- Welcome, Leases, Accepted, JoinWeightGroup, Shutdown
and receives weights from each model's learner rank 0 over a torch.distributed group
(drmas/transports/weights/) when the broker sends JoinWeightGroup; an engine whose model
runs in other processes (vllm: engines.ReceivesWeights) joins that group from its workers.

One asyncio loop: every episode of every held lease is a coroutine that awaits its
engine, so the engines batch across all of them. Weight joins are handled strictly in
arrival order (the broker sends them to every actor in the same order, so two learners
publishing at once can never wait on each other), at a safe point: the engine is paused
once the first bucket has arrived (drmas/actors/loading.py), so it generates on through
the roll call and the rendezvous; an engine whose workers join (vLLM, SGLang) is paused
before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
import zlib
from pathlib import Path
from typing import Any, TypeVar

from drmas import cpu_share
from drmas.actors.engines import ReceivesWeights, RollsBack, make_engine
from drmas.actors.engines.base import Engine
from drmas.actors.engines.expected import expected_for
from drmas.actors.failures import (
    STOP_EXIT_CODE,
    Failure,
    FailureWatch,
    group_failure,
    report_path,
)
from drmas.actors.loading import Pausing, load_here, log_load, wants_digest
from drmas.actors.timebook import TimeBook
from drmas.config import DrmasConfig
from drmas.protocol.messages import (
    Accepted,
    Episode,
    ErrorReply,
    Goodbye,
    Heartbeat,
    JoinWeightGroup,
    Lease,
    LeaseRequest,
    LeaseReturn,
    Leases,
    Shutdown,
    WeightsLoaded,
    pack_group,
)
from drmas.teams.base import Team
from drmas.teams.resolve import resolve
from drmas.threads import env_threads
from drmas.transports.channel import BrokerClient, BrokerRefused, BrokerUnavailable
from drmas.transports.weights import WeightReceiver

log = logging.getLogger("drmas.actor")
T = TypeVar("T")


REQUEST_TIMEOUT_S = 30.0
"""One attempt of a request to the broker."""
REQUEST_ATTEMPTS = 4
"""Attempts before the actor gives up on a silent broker (backoff 1, 2, 4 s between):
a broker stalled for up to ~2 minutes loses no actor."""
GOODBYE_LINGER_MS = 2000
"""Longest wait on exit for the Goodbye to reach the broker."""
REASON_CHARS = 300
"""A handed-back lease's reason is clipped to this (the log has the whole error)."""
LOOP_S = 0.02
"""Longest turn of the main loop (a running group that finishes ends it at once)."""


def is_unknown_client(msg: object) -> bool:
    """The broker's refusal of a message from a connection it does not know (any more)."""
    return isinstance(msg, ErrorReply) and msg.code == "unknown_client"


def _fault_kill_holding_leases(leases: list[Lease]) -> None:
    """Fault injection for tests: DRMAS_FAULT_KILL_HOLDING_LEASES=1 SIGKILLs this actor as
    soon as it has been granted leases, so it dies holding work it will never return (no
    Goodbye: only missed heartbeats tell the broker; tests/integration/test_faults.py)."""
    if leases and os.environ.get("DRMAS_FAULT_KILL_HOLDING_LEASES") == "1":
        log.warning("fault injection: SIGKILL holding %d leases", len(leases))
        os.kill(os.getpid(), signal.SIGKILL)


class Actor:
    def __init__(self, cfg: DrmasConfig, actor_id: str) -> None:
        self.cfg = cfg
        self.id = actor_id
        self.models = cfg.actor.models or sorted(cfg.models)
        self.client = BrokerClient(
            cfg.broker.address,
            actor_id,
            max_message_bytes=cfg.broker.max_message_bytes,
            security=cfg.security,
        )
        self.engines: dict[str, Engine] = {}
        self.workflow: Team | None = None
        self.running: dict[int, asyncio.Task[list[Episode]]] = {}
        self.leases: dict[int, Lease] = {}
        self.started_at: dict[int, float] = {}
        self.joins: list[tuple[JoinWeightGroup, float]] = []  # (join, when received)
        self.receiver = WeightReceiver(
            expected=lambda j: expected_for(self.engines.get(j.model), j)
        )
        self.quarantined: dict[str, int] = {}  # model -> version before a failed in-place load
        self.stopping = ""
        self.heartbeat_s = cfg.broker.heartbeat_interval_s
        self.book = TimeBook()
        self.failures = FailureWatch(
            cfg.workflow.name,
            actor_id,
            cfg.actor.max_failed_groups,
            report_path(cfg.run.dir, actor_id),
            min_seconds=cfg.actor.min_failing_s,
        )
        self.gave_up: Failure | None = None
        """Set when the team's code kept failing (actor.max_failed_groups): the actor stops."""

    # ----------------------------------------------------------------- setup
    async def start(self) -> None:
        """Load every engine first, then say Hello: an actor the broker knows must be able
        to join a weight group at once (a loading actor would stall everyone's rendezvous)."""
        for model in self.models:
            # every actor samples its own stream (same seed on all actors would correlate them)
            pool_cfg = self.cfg.actor.engine_of(model)
            seed = pool_cfg.seed + zlib.crc32(self.id.encode())
            engine_cfg = dataclasses.replace(pool_cfg, seed=seed)
            path = self.cfg.models[model].path
            engine = make_engine(model, path, engine_cfg, **engine_adapters(self.cfg, model))
            await engine.start()
            self.engines[model] = engine
        tokenizers = {m: e.tokenizer for m, e in self.engines.items()}
        agent_models = {a: self.cfg.model_of(a) for a in self.cfg.agents}
        self.workflow = make_workflow(self.cfg, agent_models, self.engines, tokenizers)
        self.failures.team = self.workflow.name
        welcome = self.client.hello("actor", self.models, timeout_s=REQUEST_TIMEOUT_S)
        self.id = self.client.client_id  # the broker's name for it (another if its was taken)
        self.heartbeat_s = welcome.heartbeat_interval_s
        log.info("actor %s serving %s (run %s)", self.id, self.models, welcome.run_id)

    # ------------------------------------------------------------------ loop
    async def run(self) -> None:
        await self.start()
        beating = asyncio.create_task(self.heartbeats())
        last_ask = 0.0
        retry_after = 0.0
        try:
            while not self.stopping:
                self.book.tick("generating" if self.running else "waiting_for_leases")
                cpu_share.set_busy(bool(self.running))  # lends the CPUs while it waits
                self.drain_inbox()
                if self.stopping:  # a Shutdown just read: the broker may already be gone,
                    break  # so ask it nothing more (the request would wait out its timeout)
                if self.joins:
                    await self.sync_weights()
                    self.book.tick("loading_weights")
                    if self.stopping:  # a Shutdown read between two loads
                        break
                await self.send_finished()
                now = time.monotonic()
                free = self.cfg.actor.max_groups - len(self.running)
                if free > 0 and now - last_ask >= retry_after and not self.quarantined:
                    retry_after = await self.ask_for_leases(free)
                    last_ask = now
                await self.idle()
        finally:
            beating.cancel()
            await self.stop()

    async def idle(self) -> None:
        """Between two turns of the loop: until a running group finishes, or LOOP_S (the
        inbox: weight joins, a Shutdown). Woken by the groups, not a 2 ms poll that took
        the GIL from the engine's decode thread 500 times a second."""
        running = list(self.running.values())
        if running:
            await asyncio.wait(running, timeout=LOOP_S, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(LOOP_S)

    def versions(self) -> dict[str, int]:
        return {m: e.version for m, e in self.engines.items()}

    def drain_inbox(self) -> None:
        while (msg := self.client.recv(timeout_s=0)) is not None:
            match msg:
                case JoinWeightGroup():
                    self.joins.append((msg, time.monotonic()))
                case Shutdown():
                    self.stopping = f"broker: {msg.reason}"
                case ErrorReply(code="unknown_client"):  # dropped (e.g. long silence): rejoin
                    self.rejoin(msg.reason)
                    return
                case _:
                    log.debug("ignoring unsolicited %s", type(msg).__name__)

    def rejoin(self, why: str) -> None:
        """The broker dropped this actor (missed heartbeats or weight publishes): say Hello
        again, once. Every message of the inbox came before that Hello and belongs to the
        dropped membership (its weight groups, the refusals of its other messages), so all
        but a Shutdown go; so do the refusals that reach us before the Welcome. Left there,
        each would be a second Hello, which re-registers the actor and ends what the first
        one was given."""
        log.warning("the broker forgot this actor (%s); saying hello again", why)
        inbox = self.client.inbox
        shutdowns = [m for m in inbox if isinstance(m, Shutdown)]
        inbox.clear()
        inbox.extend(shutdowns)
        self.client.hello("actor", self.models, timeout_s=REQUEST_TIMEOUT_S)
        self.id = self.client.client_id  # another name when its own is still held
        fresh = [m for m in inbox if not is_unknown_client(m)]
        inbox.clear()
        inbox.extend(fresh)

    def shutdown_pending(self) -> bool:
        return bool(self.stopping) or any(isinstance(m, Shutdown) for m in self.client.inbox)

    def shut_down_meanwhile(self, exc: BrokerUnavailable) -> bool:
        """A request went unanswered: True (and stop) if the broker said Shutdown meanwhile
        (it answered the request's race by exiting: the run is over, not broken); else the
        broker is gone and the caller re-raises `exc`."""
        if self.stopping:  # drain_inbox read the Shutdown already
            log.info("no answer after the broker's Shutdown (%s): stopping", exc)
            return True
        shutdown = next((m for m in self.client.inbox if isinstance(m, Shutdown)), None)
        if shutdown is None:
            return False
        log.info("no answer after the broker's Shutdown (%s): stopping", exc)
        self.stopping = f"broker: {shutdown.reason}"
        return True

    async def ask(self, message: object, expect: type[T]) -> T:
        """A request that waits without blocking the loop (heartbeats and episodes go on)
        and is retried with backoff; BrokerUnavailable after REQUEST_ATTEMPTS silent tries.
        A retried LeaseRequest whose first answer comes late leaves those leases unused
        (they expire); a retried GroupResult is refused as already returned: nothing is
        trained twice. Nothing is sent once a Shutdown was read (the broker may be gone:
        the request would only wait out its timeout): BrokerUnavailable at once."""
        if self.stopping:
            raise BrokerUnavailable(f"the broker said Shutdown; {type(message).__name__} not sent")
        for attempt in range(REQUEST_ATTEMPTS):
            try:
                return await self.client.arequest(
                    message, expect, REQUEST_TIMEOUT_S, give_up_on=(Shutdown,)
                )
            except BrokerUnavailable as exc:
                if attempt + 1 == REQUEST_ATTEMPTS or self.shutdown_pending():
                    raise
                log.warning("%s; retrying (%d of %d)", exc, attempt + 2, REQUEST_ATTEMPTS)
                await asyncio.sleep(2.0**attempt)
        raise AssertionError("unreachable")

    async def ask_for_leases(self, free: int) -> float:
        try:
            reply = await self.ask(LeaseRequest(self.id, free, self.versions()), Leases)
        except BrokerRefused as exc:
            self.rejoin(f"lease request refused: {exc}")
            return 1.0
        except BrokerUnavailable as exc:
            if self.shut_down_meanwhile(exc):
                return 0.0
            raise
        assert self.workflow is not None, "leases are only asked for after start()"
        _fault_kill_holding_leases(reply.leases)
        for lease in reply.leases:
            self.leases[lease.lease_id] = lease
            self.started_at[lease.lease_id] = time.monotonic()
            sampling = lease.sampling
            self.running[lease.lease_id] = asyncio.create_task(
                self.workflow.run_group(lease.task, sampling, lease.group_size)
            )
        return max(reply.retry_after_s, self.failures.backoff_s())

    async def send_finished(self) -> None:
        for lease_id in [i for i, t in self.running.items() if t.done()]:
            task = self.running.pop(lease_id)
            lease = self.leases.pop(lease_id)
            seconds = time.monotonic() - self.started_at.pop(lease_id)
            exc = group_failure(task)
            if exc is not None:  # the team's code raised: the group is tried again elsewhere
                self.client.send(LeaseReturn(self.id, [lease_id], repr(exc)[:REASON_CHARS]))
                if self.failures.failed(exc, lease.group_id):
                    self.give_up()
                    return
                continue
            self.failures.succeeded()
            result = pack_group(self.id, lease_id, lease.group_id, task.result(), seconds)
            try:
                ack = await self.ask(result, Accepted)
            except BrokerRefused as exc:
                log.error("group %d refused by the broker: %s", lease.group_id, exc)
                continue
            except BrokerUnavailable as exc:
                if self.shut_down_meanwhile(exc):
                    return
                raise
            if not ack.accepted:
                log.warning("group %d not accepted: %s", lease.group_id, ack.reason)

    def give_up(self) -> None:
        """The team failed actor.max_failed_groups groups in a row: stop (the groups still
        running are handed back with the Goodbye) and say why; the exit code tells `drmas
        train` to stop the run."""
        self.gave_up = self.failures.gave_up()
        self.stopping = f"the {self.gave_up.team} team keeps failing"
        log.error("stopping: %s", self.gave_up.stop_message())

    async def sync_weights(self) -> None:
        """Receive pending weight publishes in arrival order, each at a safe point.

        The receive runs in a worker thread (heartbeats go on meanwhile). A join superseded
        by a newer one for the same model (read from the inbox before each), or older than
        its timeout (its learner has given up), is skipped."""
        while self.joins:
            self.drain_inbox()
            if self.stopping:  # the run is over: its learners may be gone already
                return
            join, received = self.joins.pop(0)
            newer = any(j.model == join.model for j, _ in self.joins)
            if newer or time.monotonic() - received > join.timeout_s:
                why = "superseded by a newer publish" if newer else "expired while queued"
                self.client.send(WeightsLoaded(self.id, join.model, join.version, 0.0, False, why))
                continue
            engine = self.engines[join.model]
            start = time.monotonic()
            ok, error, digest = True, "", ""
            want_digest = wants_digest(self.cfg, join.model)
            pausing = Pausing(engine, [("join", start)])  # and where the load's time went
            held = engine.version
            try:
                if isinstance(engine, ReceivesWeights):  # its own workers join the group
                    await pausing()
                    digest = await engine.receive_weights(join, want_digest)
                else:  # paused once the first bucket is in
                    digest = await load_here(engine, self.receiver, join, want_digest, pausing)
            except Exception as exc:  # a failed sync must not kill the actor: it re-syncs later
                ok, error = False, f"{type(exc).__name__}: {exc}"
                if pausing.paused:
                    error += self.after_failed_load(join.model, engine, pausing.backup, held)
                else:
                    error += f"; nothing loaded, v{engine.version} serving on"
                log.error("weight sync %s failed: %s", join.group_name, error)
            else:
                if self.quarantined.pop(join.model, None) is not None:
                    log.info("%s v%d loaded: leasing again", join.model, join.version)
            finally:
                if pausing.paused:
                    pausing.marks.append(("resume", time.monotonic()))
                    await engine.resume()
            seconds = time.monotonic() - start
            log_load(join, ok, [*pausing.marks, ("", start + seconds)])
            self.client.send(
                WeightsLoaded(self.id, join.model, join.version, seconds, ok, error, digest)
            )
            self.receiver.release()  # group teardown after generation resumed

    def after_failed_load(
        self, model: str, engine: Engine, backup: object | None, held: int
    ) -> str:
        """Never generate with half-loaded weights: an engine that can roll back serves its
        previous version again; one that cannot (its own workers loaded in place) is
        quarantined: its groups are handed back and no lease is asked for until a publish
        loads completely (the broker re-publishes to actors behind). Returns what was done,
        for the log and the WeightsLoaded error. `held`: the version before the load."""
        if backup is not None and isinstance(engine, RollsBack):
            engine.restore_weights(backup)
            return f"; previous weights v{engine.version} restored and serving"
        engine.version = held  # what it reports: the broker sees it behind and re-publishes
        self.quarantined[model] = held
        for lease_id in list(self.running):
            self.running.pop(lease_id).cancel()
            self.leases.pop(lease_id, None)
            self.started_at.pop(lease_id, None)
            self.client.send(LeaseReturn(self.id, [lease_id], f"{model} weights half-loaded"))
        return "; weights may be half-loaded: leases handed back, no new ones until a reload"

    async def heartbeats(self) -> None:
        """Its own task: beats go on while the main loop waits for a weight group."""
        while True:
            try:
                self.client.send(
                    Heartbeat(self.id, self.versions(), len(self.running), self.book.totals())
                )
            except BrokerUnavailable as exc:  # the main loop's requests decide when to give up
                log.warning("heartbeat not sent: %s", exc)
            await asyncio.sleep(self.heartbeat_s)

    # --------------------------------------------------------------- cleanup
    async def stop(self) -> None:
        unfinished = sorted(self.running)
        for task in self.running.values():
            task.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        self.running.clear()
        try:
            self.client.send(Goodbye(self.id, unfinished))
        finally:
            if self.workflow is not None:
                await self.workflow.close()
            self.receiver.close()  # the weight groups kept for the next versions
            if self.cfg.run.dir:
                logs = Path(self.cfg.run.dir) / "logs"
                with contextlib.suppress(OSError):
                    logs.mkdir(parents=True, exist_ok=True)
                    self.book.write(logs, self.id.replace("/", "_"))
            for engine in self.engines.values():
                await engine.close()
            # The client closes with linger=0, which can drop the Goodbye still queued in
            # ZeroMQ's I/O thread; then the broker would wait for missed heartbeats to
            # re-issue the leases. Give it a bounded time to leave.
            self.client.close(linger_ms=GOODBYE_LINGER_MS)
        log.info(
            "actor %s stopped (%s); handed back %d leases", self.id, self.stopping, len(unfinished)
        )


def make_workflow(
    cfg: DrmasConfig,
    agent_models: dict[str, str],
    engines: dict[str, Engine],
    tokenizers: dict[str, object],
) -> Team:
    """The configured team (`workflow.name` or `workflow.target`) with its tools (the
    search team's retriever: a local bm25/dense index, loaded from the cache `drmas train`
    built, or an HTTP server) and `workflow.reward`."""
    team = resolve(cfg, "actor")  # the user's team, tools and reward: checked, then loaded
    assert team is not None
    return team.build(cfg, agent_models, engines, tokenizers)


def engine_adapters(cfg: DrmasConfig, model: str) -> dict[str, Any]:
    """make_engine's `lora` and `adapters` for a LoRA base (one copy of the base serves
    every agent's adapter); nothing for a model that trains whole."""
    if not cfg.has_adapters(model):
        return {}
    return {"lora": cfg.models[model].lora, "adapters": cfg.adapters_of(model)}


def default_actor_id() -> str:
    return f"actor-{socket.gethostname()}-{os.getpid()}"


def run_actor(cfg: DrmasConfig, actor_id: str = "") -> int:
    """Entry point of `drmas actor`: run until the broker says Shutdown, or SIGTERM/SIGINT
    (exit code 0), or until the team's code failed actor.max_failed_groups groups in a row
    (STOP_EXIT_CODE)."""
    cpu_share.start_process(env_threads() or 1)
    actor = Actor(cfg, actor_id or cfg.actor.id or default_actor_id())

    def stop(signum: int, _frame: object) -> None:
        actor.stopping = f"signal {signum}"

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    asyncio.run(actor.run())
    if actor.gave_up is not None:
        print(f"drmas actor: {actor.gave_up.stop_message()}", file=sys.stderr, flush=True)
        return STOP_EXIT_CODE
    return 0
