"""The broker process: one ROUTER socket in front of BrokerState.

Talks to: actors (leases in, groups out, weight-group joins), learner ranks (batch
shards, step reports, publish plans) and `drmas status` clients. Every message is first
bounded on its raw frames by the intake (drmas/broker/intake.py: its parts, its size for
what its sender may send, a byte budget per peer; a peer that keeps failing them, or does
not read its replies, is dropped), then decoded with the ToBroker decoder, attributed to the client its connection was
welcomed as (drmas/broker/routes.py: routing ids are the ROUTER's, never the client's),
then admitted or refused by the gate (drmas/broker/gate.py: the
sender's role bound at Hello, its CURVE key's role, every field, the run's limits) before
it touches state; this loop only routes what the gate admits to BrokerState and sends the
replies. A refused frame gets an ErrorReply (when the sender can be answered), is counted
under `refused/<code>`, and the loop goes on. Anything unforeseen is refused as
`internal` by a last-resort handler. The loop polls with a 100 ms timeout (20 ms while
TCP connections are open) so liveness checks never stall, caps open connections per
host, in all and per CURVE key (drmas/broker/connections.py), and shuts a connection
that makes libzmq hold more than it may send before the broker can read it, such as one
message of millions of parts (drmas/broker/wire_watch.py).

Measures its own CPU time per message type (drmas/broker/cpu.py).
Writes: RUN_DIR/metrics.jsonl and the trackers of `logger` (drmas/broker/trackers.py),
RUN_DIR/samples.jsonl (drmas/broker/samples.py), broker_summary.json and its checkpoints.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import traceback
import uuid
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq

from drmas.broker.checkpoint import BrokerCheckpoints
from drmas.broker.connections import ConnectionCap
from drmas.broker.gate import Gate, InvalidGroup, RateLimit, clip
from drmas.broker.heap import tune_gc
from drmas.broker.intake import FrameLimits, Intake, Refusal
from drmas.broker.leases import LeaseRecord
from drmas.broker.limits import group_bytes, run_limits
from drmas.broker.metrics import NullSink, StepMetrics
from drmas.broker.peer_label import peer_label
from drmas.broker.routes import Routes
from drmas.broker.samples import SampleWriter, transcript_markdown
from drmas.broker.state import BrokerState
from drmas.broker.status import run_summary, status_reply
from drmas.broker.trackers import FanOut, make_sink
from drmas.config import DrmasConfig, config_dict
from drmas.protocol import ProtocolError, decode_to_broker, encode
from drmas.protocol.messages import (
    Accepted,
    BatchRequest,
    ErrorReply,
    Goodbye,
    GroupResult,
    Heartbeat,
    Hello,
    LeaseRequest,
    LeaseReturn,
    PublishDone,
    PublishRequest,
    Shutdown,
    StatusRequest,
    StepReport,
    ToBroker,
    WeightsLoaded,
    Welcome,
)
from drmas.tasks.source import TaskSource
from drmas.teams.resolve import resolve
from drmas.transports.channel import bind_router
from drmas.transports.learner_secret import load_actor_secret, load_secret
from drmas.transports.security import key_roles, keys_dir

log = logging.getLogger("drmas.broker")
_NOBLOCK = int(zmq.NOBLOCK)  # plain ints: pyzmq's flag enums cost microseconds per message
_MORE = int(zmq.SNDMORE) | _NOBLOCK
SHUTDOWN_LINGER_MS = 1000
ROUTE_STALE_BEATS = 3
"""Heartbeat intervals of silence after which a client's name may be taken by a new
connection (it restarted or reconnected: drmas/broker/routes.py)."""
"""At close, after a Shutdown broadcast: how long the socket may take to deliver it."""


class BrokerServer:
    def __init__(self, cfg: DrmasConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        team = resolve(cfg, "broker")  # the team and task source: checked, then loaded
        assert team is not None
        self.checkpoints = BrokerCheckpoints(cfg, run_dir)  # on resume: reads, rewinds metrics
        sink: FanOut | NullSink = NullSink()
        if run_dir:
            sink = make_sink(run_dir, list(cfg.logger), cfg.run.project, config_dict(cfg))
        self.run_dir = run_dir
        self.state = BrokerState(
            cfg, TaskSource(cfg.task), StepMetrics(sink, sorted(cfg.models)), uuid.uuid4().hex[:12]
        )
        self.checkpoints.restore(self.state)
        self.samples = SampleWriter.for_run(cfg, run_dir)
        self.sink = sink
        limits = run_limits(cfg, dict(self.state.agent_models), team)
        secret = load_secret(cfg.security)  # SecurityError (exit 2) if named but unreadable
        if secret is None:
            log.warning(
                "security.learner_secret is empty: any client may take a free learner seat; "
                "start the broker with --config RUN_DIR/config.yaml from `drmas prepare`"
            )
        actor_secret = load_actor_secret(cfg.security)
        if actor_secret is None:
            log.warning(
                "security.actor_secret is empty: any client may say Hello as an actor; "
                "start the broker with --config RUN_DIR/config.yaml from `drmas prepare`"
            )
        self.gate = Gate(self.state, limits, secret, actor_secret)
        self.cpu = self.state.metrics.cpu
        # CURVE: public key (z85) -> Hello roles it may take (authorized/roles.json)
        self.key_roles = key_roles(keys_dir(cfg.security)) if cfg.security.curve else None
        self._internal_logged: set[tuple[str, str]] = set()
        self._refusal_log = RateLimit(per_minute=10)
        self.ctx = zmq.Context()
        b = cfg.broker
        frames = FrameLimits(b.max_hello_bytes, b.max_control_bytes, group_bytes(cfg, limits),
                             b.max_peer_bytes_per_s, b.max_held_bytes, cfg.security.curve)  # fmt: skip
        self.sock, self.address = bind_router(self.ctx, b.address, frames.group, cfg.security)
        self.connections = ConnectionCap(
            self.sock, b.max_connections_per_host, b.max_connections, b.max_connections_per_key,
            self.key_roles, b.max_unwelcomed_connections,
        )  # fmt: skip
        # which client each connection speaks for: bound at its Hello, never chosen by it
        self.routes = Routes(stale_s=ROUTE_STALE_BEATS * b.heartbeat_interval_s)
        self.intake = Intake(
            self.sock, frames, self.connections, self.state.counters,
            lambda identity: self.state.role_of(self.routes.name_of(identity) or ""),
            lambda identity: self.state.leases_held(self.routes.name_of(identity) or ""),
        )  # fmt: skip
        self.intake.on_drop = self.routes.forget  # it reconnects and says Hello as itself
        self._stop = ""
        """Why serve() stops before training is done: the signal's name, or empty. It then
        tells every client Shutdown and serves on until the learners have said Goodbye
        (they save first), at most until _stop_by."""
        self._stop_by = 0.0
        self._shutdown_sent = False
        log.info("broker listening on %s (run %s)", self.address, self.state.run_id)

    # ------------------------------------------------------------------ loop
    def serve(self, max_seconds: float | None = None) -> None:
        """Serve until training is done, or a SIGTERM/SIGINT, and every learner has left.

        A stop from outside (drmas train's Ctrl-C, a scheduler's SIGTERM) is graceful: every
        client, actors attached from other nodes included, is told Shutdown at once and
        stops cleanly; the learners finish their step and save before they say Goodbye,
        for at most broker.stop_grace_s (a second signal stops the broker at once).

        Owns the process from here: applies the broker's garbage-collector settings.
        """
        tune_gc()
        deadline = time.monotonic() + max_seconds if max_seconds else None
        last_reap = 0.0
        try:
            watch = self.intake.watch
            while True:
                if self.sock.poll(watch.poll_ms):
                    self.connections.poll()  # shut what is over the caps before reading it
                    self.drain()
                self.connections.poll()
                if self.connections.refused:
                    self.state.counters["connections_refused"] = self.connections.refused
                now = time.monotonic()
                watch.check(now)
                if now - last_reap > 0.5:
                    started = time.thread_time()
                    self.state.reap(now)
                    gone = self.routes.prune(lambda cid: self.state.last_seen(cid) is not None)
                    self.intake.close_forgotten(gone)
                    self.intake.tick(now)
                    self.flush_samples()
                    self.cpu.add("reap", time.thread_time() - started)
                    last_reap = now
                stop = (
                    "training finished"
                    if self.state.done
                    else self.state.learners.lost  # drmas/broker/seats.py
                    or (self._stop and f"the broker was stopped ({self._stop})")
                )
                if stop and not self._shutdown_sent:
                    self.broadcast_shutdown(stop)
                if self._shutdown_sent and not self.state.active_learners(now):
                    break  # every learner said Goodbye (or has been gone for long)
                if self._stop and now > self._stop_by:
                    log.warning("broker stopping (%s) with learners still at work", self._stop)
                    break
                if deadline and now > deadline:
                    log.warning("broker stopping: max_seconds=%s reached", max_seconds)
                    break
        finally:
            self.close(linger_ms=SHUTDOWN_LINGER_MS if self._shutdown_sent else 0)

    def drain(self, max_messages: int = 256) -> None:
        """Handle what is queued (up to max_messages, so liveness checks still run); the
        intake bounds each message before it is decoded (drmas/broker/intake.py)."""
        read = self.intake.read
        for _ in range(max_messages):
            try:
                got = read()
            except zmq.Again:
                return
            if isinstance(got, Refusal):
                self.answer(got)
            else:
                self.handle(got)

    def answer(self, refusal: Refusal) -> None:
        """Tell the sender of a message the intake refused (counted there) why."""
        if refusal.answer:
            self.refuse(refusal.identity, refusal.code, refusal.reason, count=False)

    def install_signal_handlers(self) -> None:
        def stop(signum: int, _frame: object) -> None:
            # the first signal: a graceful stop (serve's loop); a second: stop now
            self._stop_by = time.monotonic() + (0.0 if self._stop else self.cfg.broker.stop_grace_s)
            self._stop = signal.Signals(signum).name

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)

    def close(self, linger_ms: int = 0) -> None:
        """Save, write the summary, close. `linger_ms`: how long the socket may still take
        to deliver what is queued (the Shutdowns just broadcast), bounded."""
        self.checkpoints.save(self.state, "broker stopping")
        if self.samples is not None and self.samples.pending:
            self.samples.ready.wait(30)  # explicit bound: a run that ends early keeps its sample
            self.flush_samples()
        self.state.metrics.close(dict(self.state.counters))
        if self.run_dir:
            summary = run_summary(self.state, self.cpu.summary(time.monotonic()))
            (self.run_dir / "broker_summary.json").write_text(json.dumps(summary, indent=2))
        self.connections.close()
        self.sock.close(linger=linger_ms)
        self.ctx.term()

    def broadcast_shutdown(self, reason: str) -> None:
        self._shutdown_sent = True
        self.state.weights.closed = True  # a learner's last publish must not wait for actors
        for cid in list(self.state.table.actors) + list(self.state.learners):
            self.send(cid, Shutdown(reason))
        log.info("shutdown sent: %s", reason)

    # -------------------------------------------------------------- dispatch
    def send(self, client_id: str, message: object, identity: bytes | None = None) -> None:
        """Queue a message for `client_id` over the connection its Hello was welcomed on
        (or over `identity`: a reply to one that said none); a peer whose queue is full
        does not read and is dropped."""
        identity = identity or self.routes.identity_of(client_id)
        if identity is None:  # its connection was let go: nothing to send it on
            self.state.counters["send_failed"] += 1
            return
        try:  # two sends with int flags: send_multipart's enum arithmetic cost more than both
            self.sock.send(identity, _MORE)
            self.sock.send(encode(message), _NOBLOCK)  # type: ignore[arg-type]
        except zmq.Again:
            self.state.counters["send_failed"] += 1
            self.intake.drop(identity, "not_reading")
        except zmq.ZMQError:
            self.state.counters["send_failed"] += 1

    def refuse(
        self, identity: bytes, code: str, reason: str, refused: str = "", count: bool = True
    ) -> None:
        if count:
            self.state.counters[f"refused/{code}"] += 1
        reason = clip(reason, 500)  # neither a log line nor a reply grows with the input
        if self._refusal_log.allow((code, refused)):  # a flood is logged, not every message
            log.warning(
                "refused %s from %s: %s: %s", refused or "frame", peer_label(identity), code, reason
            )
        # the sender may be gone or unreachable: then there is nothing to answer
        try:
            reply = encode(ErrorReply(code, reason, refused))
            self.sock.send_multipart([identity, reply], flags=zmq.NOBLOCK)
        except zmq.Again:  # its reply queue is full: it does not read
            self.intake.drop(identity, "not_reading")
        except zmq.ZMQError:
            pass

    def handle(self, frames: Sequence[zmq.Frame]) -> None:
        """One received message: [client identity, payload]. Frames are not copied: the
        decoded GroupResult's arrays are views into the payload frame."""
        started = time.thread_time()
        identity = frames[0].bytes
        if len(frames) != 2:
            self.refuse(identity, "bad_frame", f"expected 1 payload frame, got {len(frames) - 1}")
            self.cpu.add("bad_frame", time.thread_time() - started)
            return
        payload = frames[1].buffer
        tag = ""
        try:
            msg = decode_to_broker(payload)
            tag = type(msg).__struct_config__.tag  # type: ignore[assignment]
            curve_key = str(frames[1].get("User-Id")) if self.key_roles is not None else ""
            cid, msg = self._speaker(identity, msg, curve_key)
            self.dispatch(cid, msg, self._key_roles_of(frames[1]), identity, curve_key)
        except ProtocolError as exc:
            self.refuse(identity, exc.code, exc.reason, tag)
        except Exception as exc:  # last resort: a bug or an unforeseen input must not kill the run
            key = (tag, type(exc).__name__)
            if key not in self._internal_logged:  # once per message type and error type
                self._internal_logged.add(key)
                log.error(
                    "internal error on %s:\n%s", tag or "frame", clip(traceback.format_exc(), 4000)
                )
            self.refuse(identity, "internal", f"{type(exc).__name__} while handling it", tag)
        finally:
            self.cpu.add(tag or "bad_frame", time.thread_time() - started)

    def _speaker(self, identity: bytes, msg: ToBroker, key: str) -> tuple[str, ToBroker]:
        """Who a message from connection `identity` is from: the client its Hello was
        welcomed under ("" if none); for a Hello, the name it is to be welcomed under,
        which the Hello then carries (drmas/broker/routes.py)."""
        if not isinstance(msg, Hello):
            return self.routes.name_of(identity) or "", msg
        self.gate.check_actor_proof(msg)  # before the name it asks for is routed
        proven = msg.role != "learner" or self.gate.learner_secret is not None
        name = self.routes.hello_name(
            msg, identity, key, self.state.last_seen, time.monotonic(), proven
        )
        return name, msg if name == msg.client_id else msgspec.structs.replace(msg, client_id=name)

    def _key_roles_of(self, frame: zmq.Frame) -> frozenset[str] | None:
        """With CURVE: the roles the sender's key may take (its ZAP User-Id is the key)."""
        if self.key_roles is None:
            return None
        return self.key_roles.get(str(frame.get("User-Id")), frozenset())

    def dispatch(
        self,
        cid: str,
        msg: ToBroker,
        key_roles: frozenset[str] | None = None,
        identity: bytes | None = None,
        key: str = "",
    ) -> None:
        """Route one message: the gate admits it or raises (and nothing has changed), then
        BrokerState applies it and the sender gets its reply."""
        now = time.monotonic()
        st = self.state
        try:
            admitted = self.gate.admit(cid, msg, key_roles)
        except InvalidGroup as refused:
            st.refuse_group(refused.lease)  # its task is re-issued now, not at timeout
            raise
        if isinstance(msg, Hello | StatusRequest):
            # the connection it came on (an in-process caller that has none: its name)
            self.greet(cid, msg, identity if identity is not None else cid.encode(), key, now)
            return
        st.seen(cid, now)  # versions it claims are not taken: BrokerState.seen
        match msg:
            case Heartbeat():
                if msg.time_s and cid in st.table.actors:
                    st.metrics.actor_time(cid, msg.time_s)
            case LeaseRequest():
                self.send(cid, st.lease(cid, msg.max_groups, msg.versions, now))
            case GroupResult():
                self.on_group(cid, msg, admitted.lease, now)
            case BatchRequest():
                st.adapter_versions.record(msg.model, msg.version, msg.adapter_versions)
                self.send(cid, st.batch(msg.model, msg.rank, msg.world_size, msg.version, now))
            case StepReport():
                st.step_report(msg.model, msg.version, msg.metrics)
                self.checkpoints.after_step(st, msg.model, msg.version)
            case PublishRequest():
                st.adapter_versions.record(msg.model, msg.version, msg.adapter_versions)
                plan, joins = st.weights.plan(msg.model, msg.version, msg.store_address, now)
                for actor, join in joins:
                    self.send(actor, join)
                self.send(cid, plan)
            case PublishDone() | WeightsLoaded():
                self.on_weights(cid, msg)
            case LeaseReturn():
                log.warning(
                    "%s returns %d leases %s: %s",
                    cid, len(msg.lease_ids), clip(msg.lease_ids[:20]), clip(msg.reason),
                )  # fmt: skip
                st.hand_back(cid, msg.lease_ids)
            case Goodbye():
                if cid in st.learners:
                    st.learners.leave(cid, msg.reason, now)  # mid-run: stops the run
                else:
                    st.hand_back(cid, msg.lease_ids)
                    st.drop_actor(cid, "left")

    def greet(
        self, cid: str, msg: Hello | StatusRequest, identity: bytes, key: str, now: float
    ) -> None:
        """A Hello the gate admitted (the connection now speaks for `cid`), or a status
        request, answered over the connection it came on."""
        if isinstance(msg, Hello):
            self.routes.bind(cid, identity, key, msg.role)
            self.on_hello(cid, msg, now)
            return
        refusal = self.intake.allow_status(identity)
        if refusal is None:
            self.send(cid, status_reply(self.state, now), identity)
        else:
            self.answer(refusal)

    def on_hello(self, cid: str, msg: Hello, now: float) -> None:
        """Register the sender in the role it says (the gate has checked it may) and
        welcome it with the run's versions and agent -> model map."""
        st = self.state
        if msg.role == "actor":
            st.add_actor(cid, msg.host, msg.pid, msg.models, now)
        elif msg.role == "learner":
            st.add_learner(cid, msg.models[0], msg.rank, msg.world_size, now, msg.host, msg.pid)
        self.send(
            cid,
            Welcome(
                run_id=st.run_id,
                model_versions=dict(st.versions),
                agent_models=dict(st.agent_models),
                heartbeat_interval_s=self.cfg.broker.heartbeat_interval_s,
                client_id=cid,
            ),
        )

    def on_group(self, cid: str, msg: GroupResult, lease: LeaseRecord | None, now: float) -> None:
        """A finished group, with the lease the gate looked up: accepted or not, the actor
        is told; an accepted training group may become the step's sampled transcript."""
        st = self.state
        why = st.accept_leased(cid, msg, lease, now)
        self.send(cid, Accepted(msg.lease_id, accepted=not why, reason=why))
        step = min(st.versions.values())
        if (
            self.samples
            and not why
            and lease is not None
            and lease.eval_round is None
            and self.samples.due(step)
        ):
            self.samples.add(step, lease.task, msg)
            self.flush_samples()

    def on_weights(self, cid: str, msg: PublishDone | WeightsLoaded) -> None:
        """A learner's publish ended, or an actor loaded (or failed to load) weights."""
        weights = self.state.weights
        if isinstance(msg, PublishDone):
            if not msg.ok:
                log.warning("publish of %s v%d failed: %s", msg.model, msg.version, clip(msg.error))
            weights.done(
                msg.model, msg.version, msg.seconds, msg.ok, msg.digest, msg.bytes, msg.left_out,
                broke=msg.broke,
            )  # fmt: skip
            for client_id in weights.take_never_joined():
                self.state.drop_actor(client_id, "never joined")
            return
        if not msg.ok:
            log.warning(
                "%s failed to load %s v%d: %s", cid, msg.model, msg.version, clip(msg.error)
            )
        weights.loaded(cid, msg.model, msg.version, msg.ok, msg.digest, time.monotonic())

    def flush_samples(self) -> None:
        """Sampled transcripts to samples.jsonl and the trackers, once tokenizers load."""
        if self.samples is None:
            return
        for written in self.samples.flush():
            if isinstance(self.sink, FanOut):
                self.sink.text("samples", transcript_markdown(written), written["step"])
