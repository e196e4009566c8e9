"""The learner registry: which client id holds which (model, rank) seat (pure logic).

Owned by BrokerState (drmas/broker/state.py) as `state.learners`, a dict client id ->
LearnerRecord that the broker loop reads and, on a learner's Goodbye, deletes from. The
gate (drmas/broker/gate.py) asks `refusal` before a learner's Hello is admitted.

Why seats: a learner rank's registration decides who may ask for its shards, report its
steps and point the actors at a weight store. If a second Hello for a held (model, rank)
replaced the holder, any client could cut the real rank off (its next request would be
refused as an unknown client) and publish from a store of its own. So a seat belongs to
its holder until it says Goodbye or is silent for broker.learner_timeout_s; a rank that
restarts says Hello under its own id (`learner-<model>-<rank>`) and takes its seat back.
"""

from __future__ import annotations

import collections
import logging

from drmas.broker.leases import LearnerRecord

log = logging.getLogger("drmas.broker")


class LearnerSeats(dict[str, LearnerRecord]):
    """Client id -> its LearnerRecord; at most one id per (model, rank)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self.timeout_s = timeout_s

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

    def add(self, client_id: str, model: str, rank: int, world_size: int, now: float) -> None:
        """Seat `client_id` (the gate has checked `refusal`; raises ValueError if not)."""
        why = self.refusal(client_id, model, rank)
        if why:
            raise ValueError(why)
        self[client_id] = LearnerRecord(model, rank, world_size, now)

    def world_sizes(self, model: str, client_id: str) -> set[int]:
        """World sizes `model`'s other ranks said at their Hello."""
        return {r.world_size for c, r in self.items() if r.model == model and c != client_id}

    def reap(self, now: float, counters: collections.Counter[str]) -> None:
        """Free the seats of ranks silent for longer than the timeout. Learners heartbeat
        between micro-batches but can block for up to weights.timeout_s in a weight-group
        rendezvous, hence the much longer broker.learner_timeout_s."""
        for cid in [c for c, r in self.items() if now - r.last_seen > self.timeout_s]:
            del self[cid]
            counters["learners_lost"] += 1
            log.warning("learner %s silent for %.0f s: dropped", cid, self.timeout_s)

    def active(self, now: float, grace_s: float) -> int:
        """Ranks heard from within `grace_s` (still working, or saying goodbye)."""
        return sum(now - r.last_seen <= grace_s for r in self.values())
