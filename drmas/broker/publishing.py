"""Weight publishing as the broker sees it: who receives which version of each model, and
whether they hold it bit for bit. Weights never pass through here (learner rank 0 sends
them over torch.distributed, drmas/transports/weights/); this plans the groups and
keeps the books.

Owned by BrokerState (drmas/broker/state.py), which hands it the actor registry, the
models' versions, the counters and the metrics (shared, never copied). Touched only by
three messages, each checked by the gate first: PublishRequest (`plan`), PublishDone
(`done`) and WeightsLoaded (`loaded`); `stale_actors` tells a learner's BatchRequest
whether to re-publish.

Weight groups persist: a model's publishes go to the same group (the same name) while
its members and its learner's store stay the same and nothing failed, so the learner and
the actors broadcast over the group they hold instead of forming and tearing down one per
version (drmas/transports/weights/). Any change of members, a re-publish to a subset, a
failed publish or load, or a new store starts a new group under a new name.

On a LoRA base a publish carries only the adapters that changed since the version some
member holds (`AdapterVersions.to_send`, drmas/broker/adapter_versions.py): the plan
names them, and each metrics line says how many (`publish_adapters/<model>`) and how many
bytes went out (`weight_sync_bytes/<model>`, every model).

Weights prove themselves (drmas/transports/weights/receiver.py): each group gets a
secret token, handed to the learner in its WeightGroupPlan and to the group's members in
their JoinWeightGroup only, which every member proves at join; each join names the
adapters the publish carries, so a receiver can check the header against them. A load
that fails (a refused header, a digest mismatch, a timeout) leaves the actor behind, and
the learner's next BatchRequest re-publishes to it: MAX_RELOADS times in a row, then only
after a back-off that doubles with every further failure (`weight_republishes_given_up`
counts the actors that reach it), so a broken actor costs its learner one publish per
back-off, while actors whose loads failed through no fault of their own (a member that
never joined the group) get the version once the cause is gone: with every actor behind,
no group can be generated and the run would otherwise wait for a next version for ever.

A publish begins with a roll call (drmas/transports/weights/group.py): learner rank 0
sends only to the members that check in with the token within weights.join_timeout_s and
names the others in PublishDone.left_out. Those are behind, re-published to as above, and
an actor left out of MAX_MISSED_JOINS publishes in a row is dropped (a connection that
registers as an actor and never joins cannot slow every publish for ever); the count
stays with its name across a new Hello, and only a load that succeeds clears it. A
WeightsLoaded(ok) from an actor that was not sent the join, or was left out of its roll
call, changes nothing (`weight_loads_unexpected`): versions are what the broker saw
loaded, never what an actor claims. An actor that
checked in to a publish and has not yet reported its load (`joining`: a publish that
failed at rank 0 leaves its members receiving until their own timeout) is not planned
into another publish of that model until it reports, or weights.timeout_s +
join_timeout_s have passed: it would miss that roll call through no fault of its own;
nor is it counted stale meanwhile (`stale_actors`), so its learner does not re-publish
to it while it loads.

A publish that fails at its rendezvous after the roll call names, where learner rank 0
can tell, the member whose signed entry never came (PublishDone.broke): it is counted
against that member alone, as two missed joins (it proved it was there, then held up
every member; an honest actor that stalls once is not dropped, a second break drops it).
Otherwise (a member left the group later, say) nobody can say which member broke it.
The members that checked in become suspects, and the model's next re-publishes go to one suspect at a time: the honest ones
load, and one that fails even a group of its own is counted as a missed join (dropped
after MAX_MISSED_JOINS), so no honest actor is counted and the run keeps publishing. A
member of a publish that succeeds is a suspect no more.

An actor on probation (one that missed a publish, by never checking in or by breaking a
group of its own, and has loaded nothing since) is left out of each new version's
publish and gets it by a re-publish of its own, so a culprit costs at most the one full publish it broke, never the next versions'. One
dropped for missing MAX_MISSED_JOINS publishes that says Hello again (its count kept) gets
no re-publish until a back-off has passed (weights.timeout_s, doubling with every further
miss) and no lease until it loads: a fake actor that rejoins each time it is dropped costs
its learners one join timeout per back-off, not one per publish.

Bounded: digests are kept for the last three versions of each model only.
"""

from __future__ import annotations

import collections
import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from drmas.broker.leases import ActorRecord
from drmas.protocol.messages import JoinWeightGroup, WeightGroupPlan

if TYPE_CHECKING:
    from drmas.broker.adapter_versions import AdapterVersions
    from drmas.broker.metrics import StepMetrics
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.broker")

MAX_RELOADS = 3
"""Failed loads of one version by one actor in a row after which it is re-published only
after a back-off (reload_backoff_s): a broken actor cannot make its learner re-publish in a
tight loop."""
MAX_BACKOFF_STEPS = 4
"""The back-off doubles at most this many times (16 × weights.timeout_s)."""
MAX_MISSED_JOINS = 3
"""Publishes in a row an actor was left out of (it did not check in within
weights.join_timeout_s) after which the broker drops it: a connection that says Hello and
heartbeats but never joins costs at most this many join timeouts. A real actor dropped so
is told unknown_client at its next message and says Hello again."""


MAX_TRACKED = 4096
"""Names whose missed joins are remembered after they leave (bounded memory)."""


class WeightPublishing:
    def __init__(
        self,
        cfg: DrmasConfig,
        actors: dict[str, ActorRecord],
        versions: dict[str, int],
        counters: collections.Counter[str],
        metrics: StepMetrics,
        adapter_versions: AdapterVersions,
    ) -> None:
        self.cfg = cfg
        self.adapter_versions = adapter_versions
        self.actors = actors
        self.versions = versions
        self.counters = counters
        self.metrics = metrics
        self.planned: dict[str, int] = {}  # model -> version of its last weight-group plan
        self.carried: dict[str, int] = {}  # LoRA base -> adapters its last plan carried
        self.in_flight: dict[str, float] = {}  # model -> deadline of the publish in flight
        # (model, version) -> the learner's fingerprint / each actor's, until compared
        self.sent_digest: dict[tuple[str, int], str] = {}
        self.loaded_digest: dict[tuple[str, int], dict[str, str]] = {}
        self._seq = 0
        # unique across broker restarts: a resumed broker never reuses an old group's name
        self._incarnation = secrets.token_hex(3)
        # model -> (group name, store address, members, token) of the group its publishes reuse
        self.groups: dict[str, tuple[str, str, tuple[str, ...], str]] = {}
        # (actor, model) -> (version, failed loads of it in a row, time of the last one)
        self.failed_loads: dict[tuple[str, str], tuple[int, int, float]] = {}
        self.closed = False  # the run is over and actors were told to stop: publish to none
        self.members: dict[str, list[str]] = {}  # model -> members of its last plan
        # model -> members of a failed publish not yet tried alone (`_failed_group`)
        self.suspects: dict[str, list[str]] = {}
        self.missed_joins: collections.Counter[str] = collections.Counter()  # in a row
        self.missed_at: dict[str, float] = {}  # name -> time of its last miss
        self.never_joined: list[str] = []  # reached MAX_MISSED_JOINS: for the state to drop
        # (actor, model) -> when it was sent a join it has neither loaded nor been left out
        # of: it may still be receiving (a broadcast that failed ends at its timeout), so
        # it is not planned into another publish until it reports (or the bound passes)
        self.joining: dict[tuple[str, str], float] = {}
        # (actor, model) -> (version, digest) of an ok that came while the publish was still
        # going: taken at its PublishDone, once the roll call says whether it checked in
        self.early_oks: dict[tuple[str, str], tuple[int, str]] = {}

    def stale_actors(self, model: str, version: int, now: float) -> list[str]:
        """Actors holding weights older than `version` while no publish of `model` is in
        flight (a failed sync, or an actor that attached mid-run): they need a re-publish."""
        if now < self.in_flight.get(model, 0.0):
            return []
        return sorted(
            a.client_id
            for a in self.actors.values()
            if model in a.models
            and a.versions.get(model, 0) < version
            and not self._busy(a.client_id, model, now)  # still loading: not stale (yet)
            and self._may_retry(a.client_id, model, version, now)
            and self._may_rejoin(a.client_id, now)
        )

    def _on_probation(self, client_id: str) -> bool:
        """Missed a publish (never checked in, or broke a group of its own) and loaded
        nothing since: a new version goes to it by a re-publish, never in the full publish
        the other actors wait on. (A mere suspect is not: a publish that failed for a
        passing reason must not turn every next version into one publish per actor.)"""
        return self.missed_joins[client_id] > 0

    def _probation_alone(self, stale: list[str]) -> list[str]:
        """The members of a re-publish: the stale actors not on probation; once none is
        left, one on probation, alone (one that broke a group breaks no one else's)."""
        trusted = [cid for cid in stale if not self._on_probation(cid)]
        return trusted or stale[:1]

    def _may_rejoin(self, client_id: str, now: float) -> bool:
        """False while an actor dropped for missing MAX_MISSED_JOINS publishes (and
        welcomed again) waits out its back-off: weights.timeout_s after its last miss,
        doubling with each further one."""
        backoff = self.rejoin_backoff_s(client_id)
        return backoff == 0.0 or now >= self.missed_at.get(client_id, 0.0) + backoff

    def rejoin_backoff_s(self, client_id: str) -> float:
        missed = self.missed_joins[client_id]
        if missed < MAX_MISSED_JOINS:
            return 0.0
        steps = min(missed - MAX_MISSED_JOINS, MAX_BACKOFF_STEPS)
        return self.cfg.weights.timeout_s * 2**steps

    def reload_backoff_s(self, failures: int) -> float:
        """How long after its last failed load an actor waits for its next re-publish of
        the same version: none for the first MAX_RELOADS - 1, then weights.timeout_s,
        doubling with each further failure (bounded)."""
        if failures < MAX_RELOADS:
            return 0.0
        return self.cfg.weights.timeout_s * 2 ** min(failures - MAX_RELOADS, MAX_BACKOFF_STEPS)

    def _may_retry(self, client_id: str, model: str, version: int, now: float) -> bool:
        failed = self.failed_loads.get((client_id, model))
        if failed is None or failed[0] != version:
            return True
        _, count, at = failed
        return count < MAX_RELOADS or now >= at + self.reload_backoff_s(count)

    def plan(
        self, model: str, version: int, store_address: str, now: float
    ) -> tuple[WeightGroupPlan, list[tuple[str, JoinWeightGroup]]]:
        """The group for one publish: every actor serving `model`, or on a re-publish of
        the same version only those that lack it; on a LoRA base, the adapters that changed
        since what some member holds. Returns the plan for the learner and the join for
        each member."""
        self._seq += 1
        full = False
        if self.closed:  # after Shutdown: no actor is there to receive (nor needs to)
            members: list[str] = []
        elif version >= self.cfg.train.steps and not self.cfg.val.every:
            # the last step's weights: no generation and no final validation will use them,
            # and actors told to stop meanwhile would leave the learner waiting
            members = []
            self.counters["weight_publishes_after_last_step_skipped"] += 1
        elif self.planned.get(model) == version:
            members = self._one_suspect(model, self.stale_actors(model, version, now))
            members = self._probation_alone(members)
            self.counters["weight_republishes"] += 1
        else:
            serving = sorted(a.client_id for a in self.actors.values() if model in a.models)
            members = [cid for cid in serving if not self._on_probation(cid)]
            self.counters["weight_joins_on_probation"] += len(serving) - len(members)
            full = True
        busy = [cid for cid in members if self._busy(cid, model, now)]
        if busy:
            self.counters["weight_joins_deferred"] += len(busy)
            members = [cid for cid in members if cid not in busy]
        for cid in members:
            self.joining[(cid, model)] = now
        self.planned[model] = version
        self.members[model] = members
        adapters = self._adapters(model, version, members)
        name, token = self._group_name(model, store_address, members, full)
        timeout = self.cfg.weights.timeout_s
        size = len(members) + 1
        joins = [
            (
                cid,
                JoinWeightGroup(
                    model, version, name, store_address, i + 1, size, timeout, token, adapters
                ),
            )
            for i, cid in enumerate(members)
        ]
        if members:
            self.in_flight[model] = now + timeout + self.cfg.broker.heartbeat_timeout_s
        else:
            self.done(model, version, 0.0, ok=True)
        return WeightGroupPlan(model, version, name, members, timeout, adapters, token), joins

    def _adapters(self, model: str, version: int, members: list[str]) -> list[str]:
        """What a publish of `version` to `members` carries on a LoRA base (counted for the
        metrics line): members that never loaded a version hold v0, the initial adapters."""
        if not self.cfg.has_adapters(model):
            return []
        held = [self.actors[c].versions.get(model, 0) for c in members]
        adapters = self.adapter_versions.to_send(model, version, held)
        self.carried[model] = len(adapters)
        return adapters

    def _group_name(
        self, model: str, store: str, members: list[str], full: bool
    ) -> tuple[str, str]:
        """(name, token) of the model's kept group when this publish goes to the same
        members over the same store; else of a new group (kept for the next publish if
        `full`) with a fresh token, which only the learner and these members are told."""
        kept = self.groups.get(model)
        if members and full and kept is not None and kept[1:3] == (store, tuple(members)):
            self.counters["weight_groups_kept"] += 1
            return kept[0], kept[3]
        name = f"{model}/{self._incarnation}/g{self._seq}"
        token = secrets.token_hex(16)
        if members:
            self.counters["weight_groups_formed"] += 1
        if full and members:
            self.groups[model] = (name, store, tuple(members), token)
        else:  # a one-off group (a subset re-publish): the learner retires the kept one
            self.groups.pop(model, None)
        return name, token

    def forget_group(self, model: str) -> None:
        """A failure in the model's group: its next publish forms a new one."""
        self.groups.pop(model, None)

    def done(
        self,
        model: str,
        version: int,
        seconds: float,
        ok: bool,
        digest: str = "",
        sent_bytes: int = 0,
        left_out: Sequence[str] = (),
        now: float | None = None,
        broke: Sequence[str] = (),
    ) -> None:
        """The learner's publish of `version` ended (PublishDone; or a plan without members).
        `left_out`: members that did not check in at its roll call (see `_left_out`);
        `broke`: members the learner saw check in and never join (a failed publish)."""
        now = time.monotonic() if now is None else now
        self.counters["weight_publishes" if ok else "weight_publishes_failed"] += 1
        self.in_flight.pop(model, None)
        if not ok or left_out:  # a group of other members formed: the next one is new
            self.forget_group(model)
        self._left_out(model, version, left_out, now)
        for key in [k for k in self.early_oks if k[1] == model]:
            early_version, early_digest = self.early_oks.pop(key)
            self.loaded(key[0], model, early_version, True, early_digest)
        present = [m for m in self.members.get(model, []) if m not in left_out]
        for client_id in [c for c in broke if c in self.actors]:  # known: no suspects
            self.joining.pop((client_id, model), None)  # it is receiving nothing
            self._failed(client_id, model, version, now)
            self._missed(client_id, version, "checked in, then never joined the group", now, 2)
        if not ok and not broke:
            self._failed_group(model, version, present, now)
        elif model in self.suspects:  # in a group that worked: not the one that breaks them
            self.suspects[model] = [c for c in self.suspects[model] if c not in present]
        if ok and digest:
            self.sent_digest[(model, version)] = digest
            self._compare(model, version)
        if version not in self.metrics.flushed:  # a re-publish of a reported step is not
            values = {  # a new metrics line
                f"weight_sync_s/{model}": seconds,
                f"weight_sync_bytes/{model}": float(sent_bytes),
            }
            if model in self.carried:
                values[f"publish_adapters/{model}"] = float(self.carried[model])
            self.metrics.report(version, model, "publish", values, dict(self.counters))

    def _failed_group(self, model: str, version: int, present: list[str], now: float) -> None:
        """A publish failed after its roll call: one of the members that checked in may have
        broken it (checked in, then never joined the group). Alone in the group, that
        member is the one: its miss is counted as a missed join. With several, each is
        tried alone in the next re-publishes (`_one_suspect`), so the one that breaks its
        own group is found and the others load; none is counted before."""
        if len(present) == 1:
            self._missed(present[0], version, "made its own group fail", now)
        elif present:
            self.suspects[model] = sorted(set(self.suspects.get(model, [])) | set(present))

    def _one_suspect(self, model: str, stale: list[str]) -> list[str]:
        """The members of a re-publish while `model` has suspects: one of them, alone (the
        first that is stale and not still receiving); else the stale actors as usual."""
        suspects = [c for c in self.suspects.get(model, []) if c in self.actors]
        if not suspects:
            self.suspects.pop(model, None)
            return stale
        pick = next((c for c in suspects if c in stale), None)
        if pick is None:
            return []  # suspects still receiving the failed group: wait for them
        suspects.remove(pick)
        self.suspects[model] = suspects
        return [pick]

    def _busy(self, client_id: str, model: str, now: float) -> bool:
        """Whether the actor may still be receiving an earlier publish of `model` (joined,
        not yet reported): weights.timeout_s + join_timeout_s after the join at most."""
        at = self.joining.get((client_id, model))
        bound = self.cfg.weights.timeout_s + self.cfg.weights.join_timeout_s
        return at is not None and now - at < bound

    def _left_out(self, model: str, version: int, left_out: Sequence[str], now: float) -> None:
        """Members that missed a publish's roll call are behind: re-published to like an
        actor whose load failed (with its back-off), and dropped after MAX_MISSED_JOINS
        publishes in a row (collected in `never_joined` for BrokerState.drop_actor)."""
        for client_id in left_out:
            self.joining.pop((client_id, model), None)  # it never checked in: not receiving
            if client_id not in self.actors:
                continue  # it said Goodbye or was dropped meanwhile
            self.counters["weight_joins_missed"] += 1
            self._failed(client_id, model, version, now)
            how = "never checked in within weights.join_timeout_s"
            self._missed(client_id, version, how, now)

    def _missed(self, client_id: str, version: int, how: str, now: float, n: int = 1) -> None:
        """`n` more publishes in a row the actor missed; at MAX_MISSED_JOINS it is dropped."""
        self.missed_joins[client_id] += n
        self.missed_at[client_id] = now
        self._bound_missed_joins()
        if self.missed_joins[client_id] >= MAX_MISSED_JOINS and client_id not in self.never_joined:
            log.error(
                "%s missed %d weight publishes in a row (the last, v%d: %s): dropping it",
                client_id, self.missed_joins[client_id], version, how,
            )  # fmt: skip
            self.never_joined.append(client_id)

    def take_never_joined(self) -> list[str]:
        """Actors to drop now (each once): they missed MAX_MISSED_JOINS publishes in a row.
        Their count is kept under their name: one that says Hello again and misses again
        is dropped at its next miss, not after MAX_MISSED_JOINS more (only a load that
        succeeds clears it)."""
        taken, self.never_joined = self.never_joined, []
        return taken

    def _bound_missed_joins(self) -> None:
        """At most MAX_TRACKED names: those of actors gone, lowest counts first, go."""
        if len(self.missed_joins) <= MAX_TRACKED:
            return
        gone = sorted(
            (n for n in self.missed_joins if n not in self.actors),
            key=lambda n: self.missed_joins[n],
        )
        for name in gone[: len(self.missed_joins) - MAX_TRACKED]:
            del self.missed_joins[name]
            self.missed_at.pop(name, None)

    def loaded(
        self,
        client_id: str,
        model: str,
        version: int,
        ok: bool,
        digest: str = "",
        now: float | None = None,
    ) -> None:
        if ok and model in self.in_flight and (client_id, model) in self.joining:
            # before PublishDone says who checked in at the roll call: an actor left out
            # must not be taken as loaded (it never received a byte)
            self.early_oks[(client_id, model)] = (version, digest)
            return
        joined = self.joining.pop((client_id, model), None) is not None
        if ok and not joined:  # left out of the roll call, or never sent a join: not loaded
            self.counters["weight_loads_unexpected"] += 1
            return
        actor = self.actors.get(client_id)
        if actor is not None and ok:
            actor.versions[model] = max(actor.versions.get(model, 0), version)
        if not ok:
            self.forget_group(model)
            self._failed(client_id, model, version, time.monotonic() if now is None else now)
        else:
            self.failed_loads.pop((client_id, model), None)
            self.missed_joins.pop(client_id, None)
            self.missed_at.pop(client_id, None)
        self.counters["weight_loads" if ok else "weight_loads_failed"] += 1
        if ok and digest and version >= self._oldest_compared(model):
            self.loaded_digest.setdefault((model, version), {})[client_id] = digest
            self._compare(model, version)
        self._prune(model)

    def _failed(self, client_id: str, model: str, version: int, now: float) -> None:
        """Count a failed load; from MAX_RELOADS in a row, the next re-publish of this
        version to the actor waits for reload_backoff_s."""
        for gone in [k for k in self.failed_loads if k[0] not in self.actors]:
            del self.failed_loads[gone]  # bounded by the actors registered now
        for gone in [k for k in self.joining if k[0] not in self.actors]:
            del self.joining[gone]
        if client_id not in self.actors:
            return
        last, count, _ = self.failed_loads.get((client_id, model), (version, 0, now))
        count = count + 1 if last == version else 1
        self.failed_loads[(client_id, model)] = (version, count, now)
        if count >= MAX_RELOADS:
            if count == MAX_RELOADS:
                self.counters["weight_republishes_given_up"] += 1
            log.error(
                "%s failed to load %s v%d %d times in a row: re-publishing it in %.0f s",
                client_id, model, version, count, self.reload_backoff_s(count),
            )  # fmt: skip

    def _compare(self, model: str, version: int) -> None:
        """Actors must hold bit for bit what the learner sent (counted, logged)."""
        sent = self.sent_digest.get((model, version))
        if sent is None:
            return
        for actor, got in self.loaded_digest.pop((model, version), {}).items():
            if got == sent:
                self.counters["weight_digest_match"] += 1
            else:
                self.counters["weight_digest_mismatch"] += 1
                log.error(
                    "%s holds %s v%d with digest %s, learner sent %s",
                    actor,
                    model,
                    version,
                    got,
                    sent,
                )
        self._prune(model)

    def _oldest_compared(self, model: str) -> int:
        """Digests of versions older than this are not compared (late loads are counted as
        loads only): with the actors' count, this bounds both digest maps."""
        return max(self.planned.get(model, 0), self.versions.get(model, 0)) - 2

    def _prune(self, model: str) -> None:
        oldest = self._oldest_compared(model)
        for table in (self.sent_digest, self.loaded_digest):
            for key in [k for k in table if k[0] == model and k[1] < oldest]:
                del table[key]
