"""Admission control: whether an actor may take another training group now (pure logic).

BrokerState.lease (drmas/broker/state.py) asks `Admission.refusal` before every training
lease it issues and `Admission.attach_wait` before any lease to an actor; a non-empty
answer is the reason the actor is told (`Leases.reason`) while it waits. The rules, with
B = batch_groups and η = algorithm.max_staleness:
- enough: no model gets more than train.steps · B groups in flight, buffered or cut;
- bounded lag: training groups in flight + buffered <= (η + 1) · B;
- fresh weights: the group will land in batch `target` of each model (the batches cut so
  far plus those the groups ahead of it fill), so the actor must hold that model's
  version >= target − η, or the group would be dropped as stale when its batch is cut;
- attach: an actor that said Hello mid-run waits until it holds, for every model, the
  version current when it attached (drmas/broker/publishing.py sends it).
Reads the lease table (drmas/broker/leases.py) and the buffers
(drmas/broker/buffers.py); changes nothing but `attach` and its counter.
"""

from __future__ import annotations

import collections

from drmas.broker.buffers import ModelBuffer
from drmas.broker.leases import ActorRecord, LeaseTable


class Admission:
    def __init__(
        self,
        steps: int,
        batch_groups: int,
        max_staleness: int,
        table: LeaseTable,
        buffers: dict[str, ModelBuffer],
        counters: collections.Counter[str],
    ) -> None:
        self.steps = steps
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.table = table
        self.buffers = buffers
        self.counters = counters
        self.attach: dict[str, dict[str, int]] = {}
        """actor -> {model: version} it must hold before its first lease (attached mid-run)."""

    def training(self) -> list[ModelBuffer]:
        """Buffers of models that still have batches to cut. A model whose agents are not
        called in every episode (the search team's Search Agent) fills its batches more
        slowly than the others; once those have cut all train.steps batches, their buffers
        must stop counting, or admission would starve the slow model."""
        return [b for b in self.buffers.values() if b.batches_cut < self.steps]

    def buffered(self) -> int:
        return max((len(b.slices) for b in self.training()), default=0)

    def groups_needed(self) -> int:
        """Training groups still to lease for every model to reach train.steps (the most
        any model needs)."""
        B, inflight = self.batch_groups, self.table.in_flight()
        return max(
            self.steps * B - b.batches_cut * B - len(b.slices) - inflight
            for b in self.buffers.values()
        )

    def refusal(self, actor: ActorRecord) -> str:
        """Why this actor may not take another training group now ("" = it may)."""
        eta, B = self.max_staleness, self.batch_groups
        if self.groups_needed() <= 0:
            return "enough groups for train.steps are in flight or buffered"
        inflight, buffered = self.table.in_flight(), self.buffered()
        if inflight + buffered >= (eta + 1) * B:
            return f"admission control: {inflight} in flight + {buffered} buffered >= (η+1)·B"
        for buf in self.training():
            m = buf.model
            target = buf.batches_cut + (inflight + len(buf.slices)) // B
            held = actor.versions.get(m, 0)
            if held < target - eta:
                return f"waiting for weights: actor has {m} v{held}, next batch needs >= v{target - eta}"
        return ""

    def attached(self, client_id: str, versions: dict[str, int]) -> None:
        """An actor joined while the models are at `versions`: its first lease waits for
        the versions above 0 (a restart under the same id starts over)."""
        self.attach[client_id] = {m: v for m, v in versions.items() if v > 0}

    def forget(self, client_id: str) -> None:
        self.attach.pop(client_id, None)

    def attach_wait(self, actor: ActorRecord) -> str:
        """Why an actor that attached mid-run gets no lease yet ("" once it holds, for every
        model, at least the version current when it said Hello)."""
        need = self.attach.get(actor.client_id)
        if not need:
            return ""
        held = actor.versions
        behind = [f"{m} v{held.get(m, 0)} < v{v}" for m, v in need.items() if held.get(m, 0) < v]
        if behind:
            return f"attached mid-run, waiting for the current weights: {', '.join(behind)}"
        del self.attach[actor.client_id]
        self.counters["actors_synced_on_attach"] += 1
        return ""
