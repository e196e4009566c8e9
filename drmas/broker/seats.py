"""The learner registry: which client id holds which (model, rank) seat (pure logic).

Owned by BrokerState (drmas/broker/state.py) as `state.learners`, a dict client id ->
LearnerRecord that the broker loop reads and, on a learner's Goodbye, frees (`leave`). The
gate (drmas/broker/gate.py) asks `refusal` before a learner's Hello is admitted.

Why seats: a learner rank's registration decides who may ask for its shards, report its
steps and point the actors at a weight store. If a second Hello for a held (model, rank)
replaced the holder, any client could cut the real rank off (its next request would be
refused as an unknown client) and publish from a store of its own. So a seat belongs to
its holder until it says Goodbye or is silent for broker.learner_timeout_s; a rank that
restarts says Hello under its own id (`learner-<model>-<rank>`) and takes its seat back.
No Hello reaches a seat without proving it under the run's learner secret (the gate's
`_check_proof`, drmas/transports/learner_secret.py), so a free seat is not first come.

Why a seat left mid-run stops the run: without that rank its model cannot step, so the
actors and the other learners would wait for ever. A seat whose holder leaves before its
model's last step (a Goodbye, which says why: a learner sent SIGTERM names its signal and
Slurm job, drmas/learners/leaving.py; or learner_timeout_s of silence) stays vacant for
broker.learner_rejoin_s; if nobody takes it back by then, `lost` says which rank left and
why, and the broker stops the run (drmas/broker/server.py) and exits non-zero. Goodbyes
after a model's last step are the run's normal end and leave nothing vacant.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

from drmas.broker.leases import LearnerRecord
from drmas.config.broker import BrokerConfig

log = logging.getLogger("drmas.broker")


@dataclass
class Vacancy:
    """A (model, rank) seat whose holder left before the model's last step."""

    model: str
    rank: int
    client_id: str
    host: str
    pid: int
    version: int
    reason: str
    since: float

    def describe(self) -> str:
        where = f"on {self.host} pid {self.pid}" if self.host else "host unknown"
        why = self.reason[:300] or "no reason given (it failed or was stopped: see its log)"
        return (
            f"{self.model} rank {self.rank} ({self.client_id!r} {where}) left at version "
            f"{self.version}: {why}"
        )


class LearnerSeats(dict[str, LearnerRecord]):
    """Client id -> its LearnerRecord; at most one id per (model, rank). Timeouts from
    `broker`; `versions` is the broker's own model -> version dict (updated in place) and
    `steps` train.steps: a rank leaving once its model is at `steps` is the normal end."""

    def __init__(self, broker: BrokerConfig, versions: dict[str, int], steps: int) -> None:
        super().__init__()
        self.timeout_s = broker.learner_timeout_s
        self.rejoin_s = broker.learner_rejoin_s
        self.versions = versions
        self.steps = steps
        self.vacant: dict[tuple[str, int], Vacancy] = {}
        self.lost = ""
        """Why the run stops: the seats left mid-run and not taken back ("" = none)."""

    def holder(self, model: str, rank: int, client_id: str = "") -> str:
        """The id, other than `client_id`, holding the (model, rank) seat ("" = free)."""
        for cid, record in self.items():
            if cid != client_id and (record.model, record.rank) == (model, rank):
                return cid
        return ""

    def refusal(self, client_id: str, model: str, rank: int) -> str:
        """Why `client_id` may not take the (model, rank) seat ("" = it may)."""
        own = self.get(client_id)
        if own is not None and (own.model, own.rank) != (model, rank):
            return (
                f"{client_id!r} holds the seat {own.model} rank {own.rank}; a learner keeps "
                "its seat until it says Goodbye"
            )
        holder = self.holder(model, rank, client_id)
        if holder:
            return (
                f"{model} rank {rank} is held by {holder!r}; the seat is free again once its "
                f"holder says Goodbye or is silent for broker.learner_timeout_s={self.timeout_s:g} s"
            )
        return ""

    def add(
        self,
        client_id: str,
        model: str,
        rank: int,
        world_size: int,
        now: float,
        host: str = "",
        pid: int = 0,
    ) -> None:
        """Seat `client_id` (the gate has checked `refusal`; raises ValueError if not); a
        vacant seat taken back keeps the run going."""
        why = self.refusal(client_id, model, rank)
        if why:
            raise ValueError(why)
        self[client_id] = LearnerRecord(model, rank, world_size, now, host, pid)
        vacancy = self.vacant.pop((model, rank), None)
        if vacancy is not None:
            log.warning(
                "%s takes back the seat of %s rank %d, vacant for %.0f s: the run goes on",
                client_id, model, rank, now - vacancy.since,
            )  # fmt: skip

    def leave(self, client_id: str, reason: str, now: float) -> None:
        """`client_id` said Goodbye (`reason`: why, "" when it finished or failed)."""
        record = self.pop(client_id, None)
        if record is not None:
            self._vacate(client_id, record, reason, now)

    def world_sizes(self, model: str, client_id: str) -> set[int]:
        """World sizes `model`'s other ranks said at their Hello."""
        return {r.world_size for c, r in self.items() if r.model == model and c != client_id}

    def reap(self, now: float, counters: collections.Counter[str]) -> None:
        """Free the seats of ranks silent for longer than the timeout (mid-run they stay
        vacant, as after a Goodbye), then set `lost` if a seat stayed vacant too long.
        Learners heartbeat between micro-batches but can block for up to weights.timeout_s
        in a weight-group rendezvous, hence the much longer broker.learner_timeout_s."""
        for cid in [c for c, r in self.items() if now - r.last_seen > self.timeout_s]:
            record = self.pop(cid)
            counters["learners_lost"] += 1
            log.warning("learner %s silent for %.0f s: dropped", cid, self.timeout_s)
            silent = f"silent for {self.timeout_s:g} s (broker.learner_timeout_s), no Goodbye"
            self._vacate(cid, record, silent, now)
        self._check_vacant(now)

    def _finished(self, model: str) -> bool:
        return self.versions.get(model, 0) >= self.steps

    def _vacate(self, client_id: str, record: LearnerRecord, reason: str, now: float) -> None:
        """The seat `client_id` held is free; mid-run, it stays vacant (see the module)."""
        if self.lost or self._finished(record.model):
            return  # the run stops already, or this model's last step is done
        version = self.versions.get(record.model, 0)
        vacancy = Vacancy(
            record.model, record.rank, client_id, record.host, record.pid, version, reason, now
        )
        self.vacant[(record.model, record.rank)] = vacancy
        log.warning(
            "learner %s; the run stops unless a learner takes the seat back within "
            "broker.learner_rejoin_s=%g s",
            vacancy.describe(), self.rejoin_s,
        )  # fmt: skip

    def _check_vacant(self, now: float) -> None:
        """Set `lost` once a seat left mid-run has stayed vacant for longer than rejoin_s."""
        if self.lost:
            return
        left = [v for v in self.vacant.values() if not self._finished(v.model)]
        if not any(now - v.since > self.rejoin_s for v in left):
            return
        named = "; ".join(v.describe() for v in left[:4]) + (
            f"; and {len(left) - 4} more ranks" if len(left) > 4 else ""
        )  # bounded: it travels in Shutdown.reason
        self.lost = (
            f"learner {named}; nobody took the seat back "
            f"within broker.learner_rejoin_s={self.rejoin_s:g} s, so the run stops. Continue "
            "it with run.resume=RUN_DIR: start the broker, then every learner group and "
            "actor, each with that override (docs/deploy.md)"
        )
        log.error("%s", self.lost)

    def active(self, now: float, grace_s: float) -> int:
        """Ranks heard from within `grace_s` (still working, or saying goodbye)."""
        return sum(now - r.last_seen <= grace_s for r in self.values())
