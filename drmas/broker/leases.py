"""Who holds which task: the actor (and learner) registry and the lease table (pure logic).

A lease is one group of one task owned by one actor. It ends in exactly one of:
returned (accepted), handed back (Goodbye), expired (lease timeout), or revoked (its
actor went silent). Anything but "returned" puts the task back at the front of the
queue; a result that arrives for a lease that no longer exists is refused, so no group
is ever trained twice.

The table's ids survive a resume (`snapshot` / `restore`, drmas/broker/checkpoint.py):
new leases and groups never reuse an id of the run's history.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from drmas.protocol.messages import Lease, SamplingParams, Task


@dataclass
class ActorRecord:
    client_id: str
    host: str
    pid: int
    models: list[str]
    last_seen: float
    versions: dict[str, int] = field(default_factory=dict)
    leases: set[int] = field(default_factory=set)
    groups_done: int = 0
    episodes_done: int = 0


@dataclass
class LearnerRecord:
    model: str
    rank: int
    world_size: int
    last_seen: float
    host: str = ""  # what its Hello said: named when the seat is left mid-run
    pid: int = 0


@dataclass
class LeaseRecord:
    lease: Lease
    actor: str
    issued_at: float
    eval_round: int | None = None  # step of the validation round, for eval leases

    @property
    def task(self) -> Task:
        return self.lease.task


class LeaseTable:
    def __init__(self, lease_timeout_s: float, group_size: int) -> None:
        self.lease_timeout_s = lease_timeout_s
        self.group_size = group_size
        self.actors: dict[str, ActorRecord] = {}
        self.leases: dict[int, LeaseRecord] = {}
        self._next_lease = 0
        self._next_group = 0
        self._in_flight = {False: 0, True: 0}  # is_eval -> leases out

    def in_flight(self, *, eval_: bool = False) -> int:
        """Leases out now (training or evaluation); O(1), asked for every lease issued."""
        return self._in_flight[eval_]

    def issue(
        self,
        actor: str,
        task: Task,
        sampling: SamplingParams,
        now: float,
        *,
        group_size: int,
        eval_round: int | None = None,
    ) -> Lease:
        self._next_lease += 1
        self._next_group += 1
        lease = Lease(
            lease_id=self._next_lease,
            group_id=self._next_group,
            task=task,
            group_size=group_size,
            is_eval=eval_round is not None,
            sampling=sampling,
            timeout_s=self.lease_timeout_s,
        )
        self.leases[lease.lease_id] = LeaseRecord(lease, actor, now, eval_round)
        self._in_flight[lease.is_eval] += 1
        self.actors[actor].leases.add(lease.lease_id)
        return lease

    def close(self, lease_id: int) -> LeaseRecord:
        record = self.leases.pop(lease_id)
        self._in_flight[record.lease.is_eval] -= 1
        actor = self.actors.get(record.actor)
        if actor is not None:
            actor.leases.discard(lease_id)
        return record

    def owned(self, lease_id: int, actor: str) -> LeaseRecord | None:
        record = self.leases.get(lease_id)
        return record if record is not None and record.actor == actor else None

    def expired(self, now: float) -> list[int]:
        return [i for i, r in self.leases.items() if now - r.issued_at > self.lease_timeout_s]

    def training_groups(self) -> dict[int, str]:
        """Group id -> task id of every training group leased out now."""
        return {
            r.lease.group_id: r.task.task_id for r in self.leases.values() if r.eval_round is None
        }

    def snapshot(self) -> dict[str, int]:
        """The next ids, and how many leases are out (a resume counts them as requeued)."""
        return {
            "outstanding_leases": len(self.leases),
            "next_lease": self._next_lease,
            "next_group": self._next_group,
        }

    def restore(self, saved: Mapping[str, Any]) -> None:
        """Continue the ids of a `snapshot` (the leases themselves are not restored: their
        tasks go back to the queue)."""
        self._next_lease = int(saved["next_lease"])
        self._next_group = int(saved["next_group"])

    def remove_actor(self, actor: str) -> list[LeaseRecord]:
        """Forget an actor; returns the leases it held (closed)."""
        record = self.actors.pop(actor, None)
        if record is None:
            return []
        return [self.close(i) for i in sorted(record.leases)]
