"""The broker's state and rules, without sockets (drmas/broker/server.py wires it; every
message it passes on has been admitted by drmas/broker/gate.py first, and nothing here
changes before that).

Owns, one component per concern:
- membership and leases: `table` (drmas/broker/leases.py: actors, leases) and `learners`
  (drmas/broker/seats.py: one id per (model, rank) seat, held until Goodbye or timeout;
  a seat left mid-run and not taken back sets `learners.lost`, which stops the run);
- the task source and validation rounds: `validation` (drmas/broker/evaluation.py);
- one buffer per model (drmas/broker/buffers.py), cut into batches;
- who may take a training group now: `admission` (drmas/broker/admission.py);
- weight publishing and digests: `weights` (drmas/broker/publishing.py);
- each LoRA base's adapter versions: `adapter_versions` (drmas/broker/adapter_versions.py);
- the models' versions, counters and metrics lines (drmas/broker/metrics.py).
`snapshot` / `restore` carry it across a resume, each component saving its own part
(the file and its consistency with the learners' checkpoints: drmas/broker/checkpoint.py).
Rules:
- admission: train groups in flight + buffered <= (η + 1) · B, and an actor gets a lease
  only if its weights are fresh enough for the batch that lease will land in (checked by
  `admission` before each lease);
- staleness: a slice that would train version v_l more than η after it was generated (on
  a LoRA base: in the versions of its steps' adapters) is dropped when its batch is cut,
  counted, and its task re-queued;
- accounting: every accepted group is trained at most once per model (checked), a
  zero-variance group skipped at intake by none (drmas/broker/variation.py).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from collections.abc import Mapping
from typing import Any

from drmas.broker.adapter_versions import AdapterVersions
from drmas.broker.admission import Admission
from drmas.broker.buffers import ModelBuffer, split_group
from drmas.broker.evaluation import Validation
from drmas.broker.leases import ActorRecord, LeaseRecord, LeaseTable
from drmas.broker.metrics import NullSink, StepMetrics
from drmas.broker.publishing import WeightPublishing
from drmas.broker.sampling import lease_sampling
from drmas.broker.seats import LearnerSeats
from drmas.broker.variation import ZeroVarianceFilter
from drmas.config import DrmasConfig
from drmas.protocol import ProtocolError
from drmas.protocol.messages import (
    BatchShard,
    GroupResult,
    Lease,
    Leases,
    NoBatch,
    Task,
)
from drmas.tasks.source import TaskSource

log = logging.getLogger("drmas.broker")


ACTORS_DROPPED = {
    "re-registered": "actors_re_registered",
    "lost": "actors_lost",
    "left": "actors_left",
    "never joined": "actors_never_joined",
}
"""Why an actor was removed -> its counter."""


class BrokerState:
    def __init__(
        self,
        cfg: DrmasConfig,
        source: TaskSource,
        metrics: StepMetrics | None = None,
        run_id: str = "",
    ) -> None:
        self.cfg = cfg
        self.source = source
        self.run_id = run_id
        self.started = time.monotonic()
        self.models = sorted(cfg.models)
        self.agent_models = {a: cfg.model_of(a) for a in cfg.agents}
        self.table = LeaseTable(cfg.broker.lease_timeout_s, cfg.group_size)
        # each LoRA base's adapter versions, fed by BatchRequest and PublishRequest
        self.adapter_versions = history = AdapterVersions(cfg)
        eta, adv = cfg.algorithm.max_staleness, cfg.algorithm.advantage
        self.buffers = {
            m: ModelBuffer(m, cfg.batch_groups, eta, adv, history.staleness_of(m))
            for m in self.models
        }
        self.versions = dict.fromkeys(self.models, 0)
        # client id -> its seat; `learners.lost`: a rank left mid-run and was not replaced
        self.learners = LearnerSeats(cfg.broker, self.versions, cfg.train.steps)
        self.metrics = metrics or StepMetrics(NullSink(), self.models)
        self.counters: collections.Counter[str] = collections.Counter()
        self.admission = Admission(
            cfg.train.steps, cfg.batch_groups, eta, self.table, self.buffers, self.counters
        )
        self.zero_variance = ZeroVarianceFilter(cfg, self.counters)
        self.trained_groups: dict[str, set[int]] = {m: set() for m in self.models}
        # (model, version, group id, task id) per trained group, until a checkpoint holds it
        self.trained_log: list[tuple[str, int, int, str]] = []
        self.accepted_groups: set[int] = set()
        self.validation = Validation(cfg)
        self.weights = WeightPublishing(
            cfg, self.table.actors, self.versions, self.counters, self.metrics, history
        )
        self.train_sampling = lease_sampling(cfg, validation=False)
        self.eval_sampling = lease_sampling(cfg, validation=True)
        if cfg.val.every:
            self._schedule_eval()  # step 0: the starting point every later round compares to

    # ------------------------------------------------------------ membership
    def actor_refusal(self, models: list[str]) -> str:
        """Why an actor serving `models` may not join ("" = it may); the gate asks first."""
        missing = sorted(set(self.models) - set(models))
        if missing:
            return f"an actor must serve every model of the team; missing {missing}"
        return ""

    def add_actor(self, client_id: str, host: str, pid: int, models: list[str], now: float) -> None:
        """Register an actor (the gate has checked `actor_refusal`; raises ValueError if not)."""
        why = self.actor_refusal(models)
        if why:
            raise ValueError(why)
        if client_id in self.table.actors:
            self.drop_actor(client_id, "re-registered")  # a restart under the same id
        self.table.actors[client_id] = ActorRecord(client_id, host, pid, models, now)
        self.counters["actors_joined"] += 1
        # An actor attaching mid-run first gets the current weights (the next publish, or
        # a re-publish to stale actors) and only then leases: no group of it is too stale.
        self.admission.attached(client_id, self.versions)

    def add_learner(
        self, cid: str, model: str, rank: int, size: int, now: float, host: str = "", pid: int = 0
    ) -> None:
        """Seat a learner rank (the gate has checked `learners.refusal`: a held seat is
        never taken over; raises ValueError if not); host and pid name it if it is lost."""
        self.learners.add(cid, model, rank, size, now, host, pid)

    def role_of(self, client_id: str) -> str | None:
        """The role `client_id` registered with ("actor", "learner"), or None."""
        if client_id in self.table.actors:
            return "actor"
        return "learner" if client_id in self.learners else None

    def last_seen(self, client_id: str) -> float | None:
        """When the actor or learner registered as `client_id` was last heard, or None."""
        record = self.table.actors.get(client_id) or self.learners.get(client_id)
        return None if record is None else record.last_seen

    def leases_held(self, client_id: str) -> int:
        """Leases the actor `client_id` holds (0 for any other client)."""
        actor = self.table.actors.get(client_id)
        return 0 if actor is None else len(actor.leases)

    def seen(self, client_id: str, now: float) -> bool:
        """Note that `client_id` was heard now. The weight versions an actor says it holds
        (in its heartbeats and lease requests) are not taken: an actor holds what the
        broker saw it load (WeightPublishing.loaded), so one that lies about its versions
        cannot take leases or validation tasks meant for fresher weights."""
        actor = self.table.actors.get(client_id)
        if actor is not None:
            actor.last_seen = now
            return True
        learner = self.learners.get(client_id)
        if learner is not None:
            learner.last_seen = now
            return True
        return False

    def drop_actor(self, client_id: str, why: str) -> None:
        self.admission.forget(client_id)
        for record in self.table.remove_actor(client_id):
            self._requeue(record.task, record.eval_round)
            self.counters["leases_reissued"] += 1
        self.counters[ACTORS_DROPPED[why]] += 1
        self.metrics.forget_actor(client_id)
        log.info("actor %s removed (%s)", client_id, why)

    def hand_back(self, client_id: str, lease_ids: list[int]) -> None:
        """The leases of `lease_ids` that `client_id` holds end; their tasks are requeued."""
        for lease_id in lease_ids:
            record = self.table.owned(lease_id, client_id)
            if record is not None:
                self._close_and_requeue(record)

    def refuse_group(self, record: LeaseRecord) -> None:
        """The gate refused a result for this held lease (it failed validation): its task
        is re-issued now, not at the lease's timeout, and the group counted as invalid."""
        self._close_and_requeue(record)
        self.counters["groups_invalid"] += 1

    def _close_and_requeue(self, record: LeaseRecord) -> None:
        self.table.close(record.lease.lease_id)
        self._requeue(record.task, record.eval_round)
        self.counters["leases_handed_back"] += 1

    def reap(self, now: float) -> None:
        """Drop silent actors and expire old leases; their tasks go back to the queue."""
        timeout = self.cfg.broker.heartbeat_timeout_s
        for actor in [a for a in self.table.actors.values() if now - a.last_seen > timeout]:
            self.drop_actor(actor.client_id, "lost")
        for lease_id in self.table.expired(now):
            record = self.table.close(lease_id)
            self._requeue(record.task, record.eval_round)
            self.counters["leases_expired"] += 1
        self.learners.reap(now, self.counters)  # after broker.learner_timeout_s of silence

    def active_learners(self, now: float) -> int:
        """Learner ranks heard from recently enough to still be working (or saying goodbye)."""
        grace = self.cfg.broker.heartbeat_timeout_s + self.cfg.weights.timeout_s
        return self.learners.active(now, grace)

    def _requeue(self, task: Task, eval_round: int | None) -> None:
        if eval_round is None:
            self.source.requeue(task)
        else:
            self.validation.requeue(task, eval_round)

    # ---------------------------------------------------------------- leases
    def lease(
        self, client_id: str, max_groups: int, versions: dict[str, int], now: float
    ) -> Leases:
        actor = self.table.actors[client_id]
        self.seen(client_id, now)  # `versions`: what it claims, not taken (see `seen`)
        waiting = self.admission.attach_wait(actor)
        if waiting:
            return Leases(leases=[], retry_after_s=0.2, reason=waiting)
        if self.weights.rejoin_backoff_s(client_id) > 0:
            return Leases(
                leases=[],
                retry_after_s=1.0,
                reason="dropped for missing weight publishes: no leases until it loads "
                "the re-publish it is sent after its back-off",
            )
        cap = self.cfg.broker.max_leases_per_actor or self.cfg.actor.max_groups
        if len(actor.leases) >= cap:
            self.counters["leases_capped"] += 1
            return Leases(
                leases=[],
                retry_after_s=0.2,
                reason=f"holds {len(actor.leases)} leases, the most one actor may "
                "(broker.max_leases_per_actor)",
            )
        max_groups = min(max_groups, cap - len(actor.leases))
        out: list[Lease] = []
        reason = ""
        queue = self.validation.queue
        while len(out) < max_groups and queue:
            task, step = queue[0]
            if min(actor.versions.get(m, 0) for m in self.models) < step:
                reason = f"validation at step {step} waits for weights v{step}"
                break
            queue.popleft()
            out.append(
                self.table.issue(
                    client_id,
                    task,
                    self.eval_sampling,
                    now,
                    group_size=self.cfg.val.n,
                    eval_round=step,
                )
            )
        while len(out) < max_groups:
            reason = self.admission.refusal(actor)
            if reason:
                break
            out.append(
                self.table.issue(
                    client_id,
                    self.source.next_task(),
                    self.train_sampling,
                    now,
                    group_size=self.cfg.group_size,
                )
            )
        if out:
            self.counters["leases_issued"] += len(out)
        return Leases(leases=out, retry_after_s=0.0 if out else 0.1, reason=reason)

    def accept(self, client_id: str, result: GroupResult, now: float) -> str:
        """Take a finished group, looking up its lease (see `accept_leased`)."""
        record = self.table.owned(result.lease_id, client_id)
        return self.accept_leased(client_id, result, record, now)

    def accept_leased(
        self, client_id: str, result: GroupResult, record: LeaseRecord | None, now: float
    ) -> str:
        """Take a finished group whose lease the caller looked up (`record`: the lease as
        `client_id` holds it, None if it holds none); returns "" or why the group is not
        accepted (nothing changes then but the count of late results)."""
        if record is None:
            self.counters["late_results_refused"] += 1
            return (
                f"lease {result.lease_id} is not held by {client_id} (expired, revoked or unknown)"
            )
        if result.group_id != record.lease.group_id:
            return f"lease {result.lease_id} is for group {record.lease.group_id}, not {result.group_id}"
        self.table.close(result.lease_id)
        actor = self.table.actors[client_id]
        actor.groups_done += 1
        actor.episodes_done += len(result.episodes)
        if record.eval_round is not None:
            self.counters["eval_groups_accepted"] += 1
            line = self.validation.record(record.eval_round, record.task, result.episodes)
            if line is not None:
                self.metrics.write(line)
            return ""
        self.accepted_groups.add(result.group_id)
        self.counters["groups_accepted"] += 1
        self.counters["episodes_accepted"] += len(result.episodes)
        self.metrics.count_intake(len(result.episodes), len(result.response_ids) // 4)
        self.metrics.count_episodes(result.episodes)
        slices = split_group(
            result.group_id,
            record.task,
            result,
            self.agent_models,
            self.cfg.algorithm.invalid_action_penalty,
            self.cfg.workflow.reward_scale,
        )
        kept = self.zero_variance.kept(slices)  # drmas/broker/variation.py
        if not kept:  # no model trains it; its task is not requeued
            return ""
        for model, part in kept.items():
            buf = self.buffers[model]
            if buf.batches_cut >= self.cfg.train.steps:
                self.counters[f"slices_after_last_batch/{model}"] += 1  # not needed any more
                continue
            buf.add(part)
        return ""

    # --------------------------------------------------------------- batches
    def batch(
        self, model: str, rank: int, world_size: int, version: int, now: float
    ) -> BatchShard | NoBatch:
        """This rank's shard of the batch for `version` (the gate has checked the buffer's
        `refusal`). Rank 0 asking for a newer version has trained the one before it, and
        takes its shard first (drmas/learners/main.py): only rank 0 moves the model's
        version and cuts a batch, so every batch cut was handed to rank 0."""
        if rank == 0:
            self.versions[model] = max(self.versions[model], version)
        if version >= self.cfg.train.steps:
            if not self.done:  # the final validation needs these weights on every actor
                stale = rank == 0 and bool(self.weights.stale_actors(model, version, now))
                why = "train.steps reached; the run's final validation is still going"
                return NoBatch(retry_after_s=0.2, reason=why, republish=stale)
            return NoBatch(retry_after_s=0.0, reason="train.steps reached", done=True)
        buf = self.buffers[model]
        if version not in buf.cut:
            if rank != 0:
                return NoBatch(retry_after_s=0.05, reason=f"rank 0 has not taken v{version} yet")
            for part in buf.drop_stale(version):
                self.counters["dropped_stale_groups"] += 1
                self.source.requeue(part.task)
        batch = buf.batch_for(version, world_size)
        if batch is None:
            stale = rank == 0 and bool(self.weights.stale_actors(model, version, now))
            return NoBatch(
                retry_after_s=0.05,
                reason=f"{len(buf.slices)}/{buf.batch_groups} groups buffered",
                republish=stale,
            )
        if len(batch.shards) != world_size:  # the group changed size after the cut
            raise ProtocolError(
                "invalid",
                f"learner of {model} asks with world size {world_size}, batch was cut for "
                f"{len(batch.shards)}",
            )
        if rank == 0 and not batch.stats_reported:  # once, however often rank 0 asks
            batch.stats_reported = True
            self.metrics.add(version + 1, batch.stats)
        return batch.shards[rank]

    def step_report(self, model: str, version: int, metrics: dict[str, float]) -> None:
        self.versions[model] = max(self.versions[model], version)
        for batch in self.buffers[model].trained(version):
            for part in batch.slices:
                if part.group_id in self.trained_groups[model]:
                    self.counters["groups_trained_twice"] += 1  # must stay 0
                self.trained_groups[model].add(part.group_id)
                self.trained_log.append((model, version, part.group_id, part.task.task_id))
            self.counters[f"batches_trained/{model}"] += 1
        # Optimizer updates the learner skipped for a non-finite gradient norm: the
        # instability Dr. MAS is about, so a total per model stays in broker_summary.json.
        skipped = metrics.get(f"skipped_steps/{model}", 0.0)
        if math.isfinite(skipped) and skipped > 0:
            self.counters[f"skipped_steps/{model}"] += int(skipped)
        self.metrics.report(version, model, "step", metrics, dict(self.counters))
        self._schedule_eval()

    # ------------------------------------------------------------ validation
    def _schedule_eval(self) -> None:
        """Open the validation rounds due at the models' lowest version."""
        self.validation.schedule(min(self.versions.values()), self.source.val_tasks)

    # ----------------------------------------------------------------- state
    @property
    def train_done(self) -> bool:
        return all(v >= self.cfg.train.steps for v in self.versions.values())

    @property
    def done(self) -> bool:
        return self.train_done and not self.validation.pending

    # ------------------------------------------------------------ checkpoint
    def forget_trained(self, covered: Mapping[str, int]) -> None:
        """Complete learner checkpoints hold each model up to version `covered[model]`:
        the trained log keeps only the groups trained after them."""
        self.trained_log[:] = [e for e in self.trained_log if e[1] > covered[e[0]]]

    def snapshot(self) -> dict[str, Any]:
        """What a resume needs, JSON-able. Work no learner checkpoint holds is saved as
        tasks to requeue: `pending` (groups leased out, buffered, or cut but not trained,
        as [group id, task id]) and the trained log (model, version, group id, task id)."""
        pending = self.table.training_groups()
        for buf in self.buffers.values():
            pending |= buf.untrained_groups()
        return {
            "run_id": self.run_id,
            "versions": dict(self.versions),
            "source": self.source.state(),
            "pending": sorted([g, t] for g, t in pending.items()),
            "trained_log": [list(e) for e in self.trained_log],
            "trained_groups": {m: sorted(g) for m, g in self.trained_groups.items()},
            "accepted_groups": sorted(self.accepted_groups),
            "counters": dict(self.counters),
            **self.table.snapshot(),
            "eval": self.validation.snapshot(),
            **self.metrics.snapshot(),
        }

    def restore(self, snap: Mapping[str, Any], versions: dict[str, int]) -> None:
        """Put a `snapshot` into this freshly built state, every model continuing at its
        version in `versions` (at most the snapshot's; drmas/broker/checkpoint.py chooses).
        The groups the learners' checkpoints do not hold come back as tasks, oldest first,
        before the task cursor moves on; validation rounds after the lowest version are
        redone."""
        self.source.load_state(snap["source"])
        requeued = self._requeue_unheld(snap, versions)
        self._restore_training(snap, versions)
        self._restore_counters(snap, len(requeued))
        self.table.restore(snap)
        self.validation.restore(snap["eval"], min(versions.values()), self.source.val_tasks())
        self.metrics.restore(versions)
        log.info(
            "broker resumed: versions %s, cursor epoch %d index %d, %d leases were in flight, "
            "requeued tasks %s",
            versions, snap["source"]["epoch"], snap["source"]["index"], snap["outstanding_leases"],
            json.dumps([requeued[g] for g in sorted(requeued)]),
        )  # fmt: skip

    def _requeue_unheld(self, snap: Mapping[str, Any], versions: dict[str, int]) -> dict[int, str]:
        """Put back the tasks of groups pending at the snapshot or trained after a model's
        resumed version, in group order; returns them (group id -> task id)."""
        requeue = {int(g): t for g, t in snap["pending"]}
        requeue |= {int(g): t for m, v, g, t in snap["trained_log"] if v > versions[m]}
        tasks = {t.task_id: t for t in self.source.train}
        for group_id in sorted(requeue, reverse=True):  # requeue() puts in front: oldest first
            self.source.requeue(tasks[requeue[group_id]])
        return requeue

    def _restore_training(self, snap: Mapping[str, Any], versions: dict[str, int]) -> None:
        """Versions, batches cut and groups trained, as of `versions`: a group trained after
        its model's resumed version is forgotten (it is served again as a new group)."""
        self.versions.update(versions)
        for m, buf in self.buffers.items():
            buf.restore(versions[m])
            retrain = {g for mm, v, g, _ in snap["trained_log"] if mm == m and v > versions[m]}
            self.trained_groups[m] = set(snap["trained_groups"][m]) - retrain
        self.accepted_groups = set(snap["accepted_groups"])
        self.trained_log.clear()

    def _restore_counters(self, snap: Mapping[str, Any], requeued: int) -> None:
        """The run's counters go on; the leases out at the snapshot count as requeued, so
        lease accounting still balances."""
        self.counters.clear()
        self.counters.update(snap["counters"])
        self.counters["leases_requeued_on_resume"] += int(snap["outstanding_leases"])
        self.counters["groups_requeued_on_resume"] += requeued
        self.counters["resumes"] += 1
