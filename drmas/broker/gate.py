"""Who may send what: the one place every message is checked before it touches state.

Called by the broker loop (drmas/broker/server.py) for every decoded message: `admit`
returns what the loop needs to route it (the sender, and for a GroupResult its lease,
looked up once), or raises ProtocolError, which the loop answers with an ErrorReply and
counts under `refused/<code>`. Reads BrokerState, never changes it:
- `protocol_version`: a Hello from another drmas version;
- `unknown_client`: the sender never said Hello (or was dropped): it should reconnect;
- `forbidden`: the sender's role (bound at its Hello) may not send this message type, or
  not for this model or rank;
- `invalid`: a field is out of range (model name, rank, world size, version, list length,
  a LoRA base's adapter versions (drmas/broker/adapter_versions.py), and the limits of
  drmas/protocol/validate.py: lease requests, groups' sizes and tokens).
A refused GroupResult for a lease its sender holds raises `InvalidGroup`, which carries
the lease: after the refusal the loop has BrokerState hand it back (`refuse_group`), so
its task is re-issued at once instead of at the lease's timeout.

Roles, bound at Hello and fixed for the connection's client id:

    actor                    Heartbeat, LeaseRequest, GroupResult, WeightsLoaded,
                             LeaseReturn, Goodbye                      (models it serves)
    learner rank r of m      Heartbeat, BatchRequest(m, r), Goodbye; rank 0 also
                             StepReport(m), PublishRequest(m), PublishDone(m)
    observer (`client`)      StatusRequest only (also allowed before any Hello)

A learner's (model, rank) seat belongs to the id holding it until Goodbye or
broker.learner_timeout_s of silence: a second claimant is refused (`forbidden`), never
swapped in (drmas/broker/seats.py). A learner Hello must carry the proof of its seat
under the run's learner secret (security.learner_secret, drmas/transports/
learner_secret.py), or it is refused (`forbidden`) whether the seat is free or not.

With CURVE, every key is bound (`drmas keys`, authorized/roles.json): to one role, to the
learner role for some models only, or to any role. The broker reads the key of every
message (its ZAP User-Id) and refuses a Hello, or any later message, that its key's
binding does not allow, so a stolen observer key cannot train or publish, and a key bound
to one model's learners cannot take another model's seat. A key with no binding gets
nothing, not even status.

Versions: only rank 0 moves a model's version (its step report: the next version, never
beyond train.steps); a rank asks for the batch of the version the model is at, rank 0
also for the next one, and a version the model has moved past only while its batch is
still cut (drmas/broker/buffers.py: no batch is cut twice or for a version no learner
trains). A learner publishes the version it has trained; an actor can hold at most what
was published, and a step it generated carries at most that.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

from drmas.protocol import PROTOCOL_VERSION, Limits, ProtocolError, validate
from drmas.protocol.messages import (
    ACTOR_TIME_STATES,
    BatchRequest,
    Goodbye,
    GroupResult,
    Heartbeat,
    Hello,
    LeaseRequest,
    LeaseReturn,
    PublishDone,
    PublishRequest,
    StatusRequest,
    StepReport,
    ToBroker,
    WeightsLoaded,
)
from drmas.transports.learner_secret import actor_proves, proves

if TYPE_CHECKING:
    from drmas.broker.leases import LeaseRecord
    from drmas.broker.state import BrokerState

log = logging.getLogger("drmas.broker")

MAX_LEASE_IDS = 4096
"""Lease ids one LeaseReturn or Goodbye may name."""
MAX_METRICS = 1024
"""Metrics one StepReport may carry."""
MAX_TEXT = 4096
"""Characters of a free-text field (an error, a reason, a digest, an address)."""
MAX_LEARNER_RANKS = 4096
"""World size a learner group may declare."""
MAX_SECONDS = 1e9
"""A time an actor may report for one state (about 30 years)."""

ALLOWED: dict[type, frozenset[str]] = {
    Heartbeat: frozenset(("actor", "learner")),
    Goodbye: frozenset(("actor", "learner")),
    LeaseRequest: frozenset(("actor",)),
    GroupResult: frozenset(("actor",)),
    WeightsLoaded: frozenset(("actor",)),
    LeaseReturn: frozenset(("actor",)),
    BatchRequest: frozenset(("learner",)),
    StepReport: frozenset(("learner",)),
    PublishRequest: frozenset(("learner",)),
    PublishDone: frozenset(("learner",)),
}
"""Message type -> roles that may send it (Hello and StatusRequest: anyone)."""

RANK0_ONLY = (StepReport, PublishRequest, PublishDone)

UNBOUND_KEY = (
    "this client's CURVE key has no binding in authorized/roles.json, so it may take no "
    "role; bind it with `drmas keys DIR --clients NAME:ROLE --force` (or add it there)"
)


@dataclass(frozen=True)
class Sender:
    """A registered client as the gate sees it."""

    role: str  # "actor" | "learner"
    models: tuple[str, ...]  # actor: models it serves; learner: (its model,)
    rank: int = 0
    world_size: int = 1


@dataclass(frozen=True)
class Admitted:
    """What the gate hands the loop with a message it admits."""

    sender: Sender | None  # None for Hello and StatusRequest, which anyone may send
    # GroupResult: the lease as its sender holds it (None: it holds none; the result is late)
    lease: LeaseRecord | None = None


class InvalidGroup(ProtocolError):
    """A GroupResult for a lease its sender holds failed validation (code and reason as
    validate.py gave them); `lease` is the lease the loop hands back after the refusal."""

    def __init__(self, refused: ProtocolError, lease: LeaseRecord) -> None:
        super().__init__(refused.code, refused.reason)
        self.lease = lease


def clip(text: object, limit: int = 200) -> str:
    """`text` for a log line or a reply: at most `limit` characters, saying what was cut."""
    s = str(text)
    return s if len(s) <= limit else f"{s[:limit]}... ({len(s) - limit} more characters)"


class RateLimit:
    """At most `per_minute` events per key in any minute, then one line saying how many
    were held back (for log lines of refusals: a flood costs counters, not disk)."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._window: dict[object, tuple[float, int]] = {}  # key -> (window start, count)

    def allow(self, key: object, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        start, count = self._window.get(key, (now, 0))
        if now - start >= 60.0:
            if count > self.per_minute:
                log.warning(
                    "%d more like %s refused in the last minute", count - self.per_minute, key
                )
            start, count = now, 0
        if len(self._window) > 1024:  # keys are (code, message type): few; never unbounded
            self._window.clear()
        self._window[key] = (start, count + 1)
        return count < self.per_minute


def _invalid(reason: str) -> NoReturn:
    raise ProtocolError("invalid", reason)


def _forbidden(reason: str) -> NoReturn:
    raise ProtocolError("forbidden", reason)


class Gate:
    """Checks senders and fields against the broker's state (read-only) and the run's
    `limits` (drmas/protocol/validate.py)."""

    def __init__(
        self,
        state: BrokerState,
        limits: Limits,
        learner_secret: bytes | None = None,
        actor_secret: bytes | None = None,
    ) -> None:
        self.state = state
        self.limits = limits
        self.learner_secret = learner_secret  # None: learner seats need no proof
        self.actor_secret = actor_secret  # None: actors need no proof

    def admit(self, cid: str, msg: ToBroker, key_roles: frozenset[str] | None = None) -> Admitted:
        """`msg` from client id `cid` if it may send it with these fields; else raises
        ProtocolError. `key_roles`: with CURVE, what the sender's key is bound to (see
        `check_key`)."""
        if isinstance(msg, Hello):
            self.check_key(msg.role, key_roles, msg.models)
            self.check_hello(cid, msg)
            return Admitted(None)
        if isinstance(msg, StatusRequest):
            if key_roles is not None and not key_roles:
                _forbidden(UNBOUND_KEY)
            return Admitted(None)  # any bound key: status is read-only
        who = self._sender_of(cid, msg)
        self.check_key(who.role, key_roles, who.models)
        if isinstance(msg, LeaseRequest):
            validate.check_lease_request(msg, self.limits)
        if isinstance(msg, GroupResult):
            return Admitted(who, self._held_lease(cid, msg))
        return Admitted(who)

    # ------------------------------------------------------------------ Hello
    def check_hello(self, cid: str, msg: Hello) -> None:
        """A Hello: the protocol version, the id it claims, the run's limits, then the
        role's own rules (`_hello_role`)."""
        if msg.protocol_version != PROTOCOL_VERSION:
            raise ProtocolError(
                "protocol_version",
                f"client speaks protocol {msg.protocol_version}, this broker speaks "
                f"{PROTOCOL_VERSION}; run the same drmas version everywhere",
            )
        if msg.client_id != cid:
            _invalid(f"Hello says {msg.client_id!r} but comes from {cid!r}")
        validate.check_hello(msg, self.limits)
        self._hello_role(cid, msg)
        if msg.role == "actor":
            why = self.state.actor_refusal(msg.models)
            if why:
                _invalid(why)

    def _check_proof(self, cid: str, msg: Hello) -> None:
        """A learner's Hello must prove its seat under the run's learner secret (when the
        broker has one): no other client can take, or take back, a learner seat."""
        if self.learner_secret is None:
            return
        if not proves(self.learner_secret, msg.proof, cid, msg.models[0], msg.rank):
            _forbidden(
                f"{cid!r} did not prove it is a learner of this run ({msg.models[0]} rank "
                f"{msg.rank}): learner ranks read the run's secret from security."
                "learner_secret (RUN_DIR/learner.secret, written by `drmas prepare`); start "
                "them with --config RUN_DIR/config.yaml and that file on their node"
            )

    def check_actor_proof(self, msg: Hello) -> None:
        """An actor's Hello must prove, under the run's actor secret (when the broker has
        one), the client id it asks for: checked before that id is routed or renamed
        (drmas/broker/server.py `_speaker`), so a stranger cannot even hold a name."""
        if self.actor_secret is None or msg.role != "actor":
            return
        if not actor_proves(self.actor_secret, msg.proof, msg.client_id):
            _forbidden(
                f"{msg.client_id[:64]!r} did not prove it is an actor of this run: actors "
                "read the run's secret from security.actor_secret (RUN_DIR/actor.secret, "
                "written by `drmas prepare`); start them with --config RUN_DIR/config.yaml "
                "and that file on their node"
            )

    def _hello_role(self, cid: str, msg: Hello) -> None:
        """Field and role checks of a Hello beyond protocol/validate.check_hello."""
        st = self.state
        if len(msg.host) > 256:
            _invalid(f"host name of {len(msg.host)} characters, at most 256")
        current = self.sender(cid)
        if current is not None and current.role != msg.role:
            _forbidden(
                f"{cid!r} is registered as {current.role}; a client id keeps its role "
                f"(use another id for a {msg.role})"
            )
        if msg.role == "client" and msg.models:
            _invalid("an observer (role client) serves no models")
        if msg.role == "learner":
            if len(msg.models) != 1:
                _invalid("a learner trains exactly one model")
            if not (1 <= msg.world_size <= MAX_LEARNER_RANKS):
                _invalid(f"learner world size {msg.world_size} outside 1..{MAX_LEARNER_RANKS}")
            model = msg.models[0]
            self._check_proof(cid, msg)
            sizes = st.learners.world_sizes(model, cid)
            if sizes and sizes != {msg.world_size}:
                _invalid(
                    f"{model} rank {msg.rank} says world size {msg.world_size}, its other ranks "
                    f"said {sorted(sizes)}: every rank of a learner group must agree"
                )
            why = st.learners.refusal(cid, model, msg.rank)
            if why:
                _forbidden(why)
        if (
            msg.role == "actor"
            and current is None
            and len(st.table.actors) >= st.cfg.broker.max_actors
        ):
            _invalid(
                f"broker.max_actors={st.cfg.broker.max_actors} actors are registered; "
                "raise it in the broker's config to attach more"
            )

    @staticmethod
    def check_key(role: str, key_roles: frozenset[str] | None, models: Sequence[str] = ()) -> None:
        """With CURVE, the sender's key must allow `role` (None: no CURVE, nothing to check).
        `key_roles` holds the Hello roles the key may take ("actor", "learner", "client");
        "learner:<model>" allows the learner role for that model only
        (drmas/transports/security.py reads them from authorized/roles.json)."""
        if key_roles is None or role in key_roles:
            return
        if not key_roles:
            _forbidden(UNBOUND_KEY)
        bound = sorted(g.partition(":")[2] for g in key_roles if g.startswith("learner:"))
        if role != "learner" or not bound:
            shown = "observer" if role == "client" else role
            _forbidden(f"this client's CURVE key is not allowed the {shown} role")
        other = [m for m in models if m not in bound]
        if other:
            _forbidden(
                f"this client's CURVE key is bound to the learners of {bound}, not of "
                f"{clip(other, 64)}"
            )

    # ------------------------------------------------------------- messages
    def sender(self, cid: str) -> Sender | None:
        st = self.state
        actor = st.table.actors.get(cid)
        if actor is not None:
            return Sender("actor", tuple(actor.models))
        learner = st.learners.get(cid)
        if learner is not None:
            return Sender("learner", (learner.model,), learner.rank, learner.world_size)
        return None

    def _sender_of(self, cid: str, msg: ToBroker) -> Sender:
        """The registered sender of `msg` if its role may send it with these fields; else
        raises. (Hello and StatusRequest need no sender: see `admit`.)"""
        who = self.sender(cid)
        if who is None:
            named = f"{cid!r}" if cid else "this connection"
            raise ProtocolError(
                "unknown_client", f"{named} has not said Hello (or was dropped); reconnect"
            )
        claimed = getattr(msg, "client_id", cid)
        if claimed != cid:
            _invalid(f"message says client {clip(claimed, 64)!r} but comes from {cid!r}")
        kind = type(msg)
        if who.role not in ALLOWED[kind]:
            _forbidden(f"a {who.role} may not send {kind.__name__}")
        check = getattr(self, f"_{kind.__name__}", None)
        if check is not None:
            check(who, msg)
        return who

    def _held_lease(self, cid: str, msg: GroupResult) -> LeaseRecord | None:
        """The lease `msg` returns, as `cid` holds it; a result for a held lease must fit
        it (group size) and the run's limits (tokens, vocabularies, agents)."""
        record = self.state.table.owned(msg.lease_id, cid)
        if record is not None:
            try:
                validate.check_group_result(msg, self.limits, record.lease.group_size)
            except ProtocolError as exc:
                raise InvalidGroup(exc, record) from exc
        return record

    # one method per message type with fields to check (looked up by name in _sender_of)
    def _Heartbeat(self, who: Sender, msg: Heartbeat) -> None:
        self._held_versions(who, msg.versions)
        unknown = set(msg.time_s) - set(ACTOR_TIME_STATES)
        if unknown:
            _invalid(f"time_s names {clip(sorted(unknown), 200)}; states are {ACTOR_TIME_STATES}")
        for state, seconds in msg.time_s.items():
            if not (0.0 <= seconds <= MAX_SECONDS):  # NaN fails too
                _invalid(f"time_s[{state!r}]={seconds} outside 0..{MAX_SECONDS:g} s")

    def _LeaseRequest(self, who: Sender, msg: LeaseRequest) -> None:
        self._held_versions(who, msg.versions)

    def _LeaseReturn(self, who: Sender, msg: LeaseReturn) -> None:
        self._lease_ids(msg.lease_ids)

    def _Goodbye(self, who: Sender, msg: Goodbye) -> None:
        self._lease_ids(msg.lease_ids)

    def _GroupResult(self, who: Sender, msg: GroupResult) -> None:
        versions = self.state.versions
        newest = max((h.version for e in msg.episodes for h in e.steps), default=0)
        if newest <= min(versions.values(), default=0):
            return  # the usual case, in one pass: no step is newer than any published version
        for episode in msg.episodes:
            for h in episode.steps:
                if h.model in versions and h.version > versions[h.model]:
                    _invalid(
                        f"a step of {h.model!r} says it was generated by v{h.version}; "
                        f"the newest published is v{versions[h.model]}"
                    )

    def _WeightsLoaded(self, who: Sender, msg: WeightsLoaded) -> None:
        self._served_model(who, msg.model)
        planned = self.state.weights.planned.get(msg.model, 0)
        if not (0 <= msg.version <= planned):
            _invalid(f"loaded {msg.model} v{msg.version}, but v{planned} is the newest sent")
        self._text(msg.error, "error")
        self._text(msg.digest, "digest")

    def _BatchRequest(self, who: Sender, msg: BatchRequest) -> None:
        self._own_rank(who, msg.model, msg.rank, msg.world_size)
        current = self.state.versions[msg.model]
        if not (0 <= msg.version <= min(current + 1, self._steps)):
            _invalid(
                f"batch for {msg.model} v{msg.version}; the learner is at v{current} "
                f"(train.steps={self._steps})"
            )
        why = self.state.buffers[msg.model].refusal(msg.rank, msg.version, current)
        if why:
            _invalid(why)
        self.state.adapter_versions.check(msg.model, msg.version, msg.adapter_versions)

    def _StepReport(self, who: Sender, msg: StepReport) -> None:
        self._own_rank(who, msg.model, 0, who.world_size)
        current = self.state.versions[msg.model]
        if msg.version != current + 1 or msg.version > self._steps:
            _invalid(
                f"step report of {msg.model} v{msg.version}; the next version is v{current + 1} "
                f"(train.steps={self._steps})"
            )
        if len(msg.metrics) > MAX_METRICS:
            _invalid(f"{len(msg.metrics)} metrics in one step report, at most {MAX_METRICS}")
        if any(len(k) > 128 for k in msg.metrics):
            _invalid("metric names are at most 128 characters")

    def _PublishRequest(self, who: Sender, msg: PublishRequest) -> None:
        self._own_rank(who, msg.model, 0, who.world_size)
        current = self.state.versions[msg.model]
        if msg.version != current:
            _invalid(f"publish of {msg.model} v{msg.version}; it has trained v{current}")
        self._text(msg.store_address, "store_address", 256)
        self.state.adapter_versions.check(msg.model, msg.version, msg.adapter_versions)

    def _PublishDone(self, who: Sender, msg: PublishDone) -> None:
        self._own_rank(who, msg.model, 0, who.world_size)
        planned = self.state.weights.planned.get(msg.model)
        if msg.version != planned:
            _invalid(f"publish done for {msg.model} v{msg.version}; the plan was for v{planned}")
        self._text(msg.error, "error")
        self._text(msg.digest, "digest")
        members = set(self.state.weights.members.get(msg.model, ()))
        strangers = sorted(set(msg.left_out) - members)
        if strangers or len(set(msg.left_out)) != len(msg.left_out):
            _invalid(f"publish done names {strangers or 'a member twice'} as left out; not members")
        named = set(msg.broke)
        if len(named) != len(msg.broke) or not named <= members - set(msg.left_out):
            _invalid("publish done names as broke a member twice, a non-member or one left out")
        if msg.ok and named:
            _invalid("publish done names members that broke a publish that worked")

    # ---------------------------------------------------------------- fields
    @property
    def _steps(self) -> int:
        return self.state.cfg.train.steps

    def _served_model(self, who: Sender, model: str) -> None:
        if model not in who.models:
            _forbidden(
                f"model {clip(model, 64)!r} is not one this {who.role} serves {list(who.models)}"
            )

    def _own_rank(self, who: Sender, model: str, rank: int, world_size: int) -> None:
        if model not in who.models:
            _forbidden(f"{clip(model, 64)!r} is not this learner's model {who.models[0]!r}")
        if (rank, world_size) != (who.rank, who.world_size):
            _forbidden(
                f"rank {rank}/{world_size} of {model}; this learner said Hello as rank "
                f"{who.rank}/{who.world_size}"
                + (" (only rank 0 reports steps and publishes)" if rank == 0 else "")
            )

    def _held_versions(self, who: Sender, versions: dict[str, int]) -> None:
        published = self.state.versions
        if len(versions) > len(published):
            _invalid(f"{len(versions)} model versions; this run has {len(published)} models")
        for model, version in versions.items():
            self._served_model(who, model)
            # a learner rank is at most one step ahead of what the broker has heard
            top = published[model] + (1 if who.role == "learner" else 0)
            if not (0 <= version <= top):
                _invalid(
                    f"claims to hold {model} v{version}; v{published[model]} is the newest "
                    "published"
                )

    @staticmethod
    def _lease_ids(ids: list[int]) -> None:
        if len(ids) > MAX_LEASE_IDS:
            _invalid(f"{len(ids)} lease ids in one message, at most {MAX_LEASE_IDS}")

    @staticmethod
    def _text(value: str, name: str, limit: int = MAX_TEXT) -> None:
        if len(value) > limit:
            _invalid(f"{name} of {len(value)} characters, at most {limit}")
