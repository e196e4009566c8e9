"""Per-model step buffers and batch cutting (pure logic, no sockets).

A finished group is scored (each step's reward -- its own Step.reward, else the episode's
team reward -- minus its invalid-action penalty: drmas/broker/scores.py) and split into
one *slice* per model: the steps of the agents bound to that model. Each model's
learner takes batches of `batch_groups` slices. When a batch is cut, advantages are
computed in one vectorised call (drmas/broker/advantages.py) over the WHOLE groups its
slices come from, every agent's steps included, and only then is this model's share taken:
splitting a group by model never changes a number, so `global` is the true GRPO baseline
(over the group's episode mean scores) and `step_global` pools every step, whichever model serves
which agent. Statistics stay per group (or pooled over the batch's groups, scope=batch).
Staleness is checked at the cut; a slice that is too stale is dropped and reported to the
caller. A whole model counts it in model versions (v_l - v_b); a LoRA base in each step's
own adapter's versions, through the staleness function BrokerState hands its buffer
(drmas/broker/adapter_versions.py).
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import numpy as np

from drmas.broker.adapter_versions import Staleness
from drmas.broker.advantages import compute_advantages
from drmas.broker.scores import step_scores
from drmas.broker.variation import variation_stats
from drmas.config.broker import AdvantageConfig
from drmas.protocol.messages import BatchShard, GroupResult, Sample, Task


class StepColumns(NamedTuple):
    """Per-step columns (of a whole group, or of one model's slice of it)."""

    agents: list[str]
    versions: list[int]
    spans: list[tuple[int, int, int, int]]  # byte offsets p0, p1, r0, r1 in the group's buffers
    scores: list[float]  # step score: its reward minus its invalid-action penalty
    rewards: list[float]  # step reward: its own (Step.reward), else the episode's team reward
    episode_ids: list[int]  # episode index within the group per step

    def take(self, steps: list[int]) -> StepColumns:
        return StepColumns(
            agents=[self.agents[i] for i in steps],
            versions=[self.versions[i] for i in steps],
            spans=[self.spans[i] for i in steps],
            scores=[self.scores[i] for i in steps],
            rewards=[self.rewards[i] for i in steps],
            episode_ids=[self.episode_ids[i] for i in steps],
        )


@dataclass
class ScoredGroup:
    """One accepted group, shared by all its slices: the columnar buffers and every step's
    score, built once (at the first cut that needs them)."""

    result: GroupResult
    penalty: float  # invalid-action penalty
    scale: Mapping[str, float] = field(default_factory=dict)  # workflow.reward_scale

    @functools.cached_property
    def columns(self) -> StepColumns:
        episodes = self.result.episodes
        headers = [h for e in episodes for h in e.steps]
        episode_of = [e for e, episode in enumerate(episodes) for _ in episode.steps]
        p_off = [0, *itertools.accumulate(4 * h.prompt_len for h in headers)]
        r_off = [0, *itertools.accumulate(4 * h.response_len for h in headers)]
        rewards, scores = step_scores(episodes, self.penalty, self.scale)
        return StepColumns(
            agents=[h.agent for h in headers],
            versions=[h.version for h in headers],
            spans=[(p_off[i], p_off[i + 1], r_off[i], r_off[i + 1]) for i in range(len(headers))],
            scores=scores,
            rewards=rewards,
            episode_ids=episode_of,
        )


@dataclass
class GroupSlice:
    """The steps of one group that train one model (advantages come at the cut).

    Points at the group's ScoredGroup (whose buffers and columns all its slices share) and
    holds the flat indices of this model's steps, so taking a group in costs one pass over
    its step headers.
    """

    group_id: int
    task: Task
    group: ScoredGroup
    steps: list[int]  # flat step indices (episode by episode) of this model's steps
    min_version: int  # oldest weight version among these steps

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def result(self) -> GroupResult:
        return self.group.result

    @functools.cached_property
    def columns(self) -> StepColumns:
        """This model's steps only."""
        return self.group.columns.take(self.steps)


@dataclass
class CutBatch:
    """One model's batch for one learner version, split into equal rank shards."""

    model: str
    version: int
    slices: list[GroupSlice]
    samples: list[Sample]
    shards: list[BatchShard]
    stats: dict[str, float] = field(default_factory=dict)
    stats_reported: bool = False  # the broker added `stats` to the step's metrics line


def split_group(
    group_id: int,
    task: Task,
    result: GroupResult,
    agent_models: dict[str, str],
    penalty: float,
    scale: Mapping[str, float] | None = None,
) -> dict[str, GroupSlice]:
    """Split a (validated) group per model: the broker's intake hot path, so one pass."""
    steps: dict[str, list[int]] = {}
    oldest: dict[str, int] = {}
    i = 0
    for episode in result.episodes:
        for h in episode.steps:
            model = agent_models[h.agent]
            if model in steps:
                steps[model].append(i)
                if h.version < oldest[model]:
                    oldest[model] = h.version
            else:
                steps[model], oldest[model] = [i], h.version
            i += 1
    group = ScoredGroup(result, penalty, scale or {})
    return {m: GroupSlice(group_id, task, group, s, oldest[m]) for m, s in steps.items()}


def slice_advantages(slices: list[GroupSlice], adv: AdvantageConfig) -> list[np.ndarray]:
    """Advantages of each slice's steps, computed over the whole groups they come from.

    One `compute_advantages` call over every step of every slice's group (all agents, all
    models), keyed by group; then each slice takes its own steps. So a model's advantages
    are exactly those of the whole group, in every mode and for any model assignment.
    """
    whole = [sl.group.columns for sl in slices]
    if not whole:
        return []
    advantages = compute_advantages(
        np.concatenate([c.scores for c in whole]),
        np.concatenate([np.full(len(c.scores), i) for i, c in enumerate(whole)]),
        np.concatenate([c.episode_ids for c in whole]),
        [agent for c in whole for agent in c.agents],
        mode=adv.mode,
        norm_by_std=adv.norm_by_std,
        eps=adv.eps,
        std=adv.std,
        scope=adv.scope,
        agent_std_pool=adv.agent_std_pool,
        std_floor=adv.std_floor,
    )
    offsets = [0, *itertools.accumulate(len(c.scores) for c in whole)]
    return [
        advantages[offset + np.asarray(sl.steps, dtype=np.intp)]
        for sl, offset in zip(slices, offsets)
    ]


def call_weights(keys: list[tuple[int, str]]) -> list[float]:
    """Per sample (its group, its agent): 1/n with n the samples of that (group, agent),
    divided by the mean of those over all the samples (so they average 1)."""
    counts = collections.Counter(keys)
    raw = [1.0 / counts[k] for k in keys]
    mean = sum(raw) / len(raw) if raw else 1.0
    return [r / mean for r in raw]


def batch_samples(slices: list[GroupSlice], adv: AdvantageConfig) -> list[Sample]:
    """This model's steps of the batch, with whole-group advantages, as training samples
    (with balance_calls, each weighted by call_weights over the batch)."""
    samples = _samples(slices, adv)
    if adv.balance_calls and samples:
        keys = [(i, agent) for i, sl in enumerate(slices) for agent in sl.columns.agents]
        for sample, w in zip(samples, call_weights(keys), strict=True):
            sample.loss_weight = w
    return samples


def _samples(slices: list[GroupSlice], adv: AdvantageConfig) -> list[Sample]:
    samples = []
    for sl, advantages in zip(slices, slice_advantages(slices, adv)):
        c = sl.columns
        prompts, responses, logprobs = (
            sl.result.prompt_ids,
            sl.result.response_ids,
            sl.result.logprobs,
        )
        for agent, version, (p0, p1, r0, r1), a in zip(
            c.agents, c.versions, c.spans, advantages.tolist()
        ):
            # views into the group's frame, not copies: encoding the shard copies them once
            samples.append(
                Sample(
                    agent,
                    cast(bytes, prompts[p0:p1]),
                    cast(bytes, responses[r0:r1]),
                    cast(bytes, logprobs[r0:r1]),
                    a,
                    version,
                )
            )
    return samples


def shard(model: str, version: int, samples: list[Sample], world_size: int) -> list[BatchShard]:
    """Split samples over ranks with equal counts (padding copies get weight 0).

    Samples are dealt longest-first round-robin so ranks get similar token counts.
    """
    total_tokens = sum(len(s.response_ids) // 4 for s in samples)
    order = sorted(samples, key=lambda s: -len(s.prompt_ids) - len(s.response_ids))
    per_rank: list[list[Sample]] = [order[r::world_size] for r in range(world_size)]
    width = max(len(p) for p in per_rank)
    shards = []
    for rank, part in enumerate(per_rank):
        weights = [1.0] * len(part) + [0.0] * (width - len(part))
        part = part + [order[0]] * (width - len(part))
        shards.append(
            BatchShard(
                model=model,
                version=version,
                rank=rank,
                world_size=world_size,
                samples=part,
                weights=weights,
                total_samples=len(samples),
                total_tokens=total_tokens,
            )
        )
    return shards


def batch_stats(
    slices: list[GroupSlice],
    samples: list[Sample],
    version: int,
    stale: Staleness | None = None,
) -> dict[str, float]:
    """Per-agent reward/score/advantage statistics and staleness of one batch (`stale`:
    how a sample's staleness is counted; None: in model versions). `reward/<agent>/mean`
    is the mean of the agent's own step rewards (its role reward where the team pays one)."""
    by_agent: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    staleness = []
    scores = [
        (score, reward)
        for sl in slices
        for score, reward in zip(sl.columns.scores, sl.columns.rewards)
    ]
    for sample, (score, reward) in zip(samples, scores):
        by_agent[sample.agent].append((reward, score, sample.advantage))
        if stale is None:
            staleness.append(version - sample.version)
        else:
            staleness.append(stale(sample.agent, version, sample.version))
    stats: dict[str, float] = {"staleness/mean": float(np.mean(staleness)) if staleness else 0.0}
    if staleness:
        stats["staleness/max"] = float(np.max(staleness))
    for agent, rows in by_agent.items():
        arr = np.array(rows)
        stats[f"reward/{agent}/mean"] = float(arr[:, 0].mean())
        stats[f"score/{agent}/mean"] = float(arr[:, 1].mean())
        stats[f"score/{agent}/std"] = float(arr[:, 1].std())
        stats[f"advantage/{agent}/mean"] = float(arr[:, 2].mean())
        stats[f"advantage/{agent}/std"] = float(arr[:, 2].std())
        stats[f"steps/{agent}"] = float(len(rows))
    return stats


class ModelBuffer:
    """FIFO of group slices for one model, and the batches cut from it.

    `stale` counts a step's staleness on a LoRA base (agent, v_l, v_b) -> versions; None
    (a whole model) counts model versions, v_l - v_b."""

    def __init__(
        self,
        model: str,
        batch_groups: int,
        max_staleness: int,
        adv: AdvantageConfig,
        stale: Staleness | None = None,
    ) -> None:
        self.model = model
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.adv = adv
        self.stale = stale
        self.slices: collections.deque[GroupSlice] = collections.deque()
        self.cut: dict[int, CutBatch] = {}  # learner version -> batch (until it reports)
        self.batches_cut = 0

    def add(self, part: GroupSlice) -> None:
        self.slices.append(part)

    def drop_stale(self, version: int) -> list[GroupSlice]:
        """Remove slices that would train `version` more than max_staleness after they were
        made: on a LoRA base, a slice any step of which is that stale in its own adapter."""
        keep: collections.deque[GroupSlice] = collections.deque()
        dropped: list[GroupSlice] = []
        for part in self.slices:
            (dropped if self._too_stale(part, version) else keep).append(part)
        self.slices = keep
        return dropped

    def _too_stale(self, part: GroupSlice, version: int) -> bool:
        eta, stale = self.max_staleness, self.stale
        if stale is None:
            return version - part.min_version > eta
        c = part.columns
        return any(stale(a, version, v) > eta for a, v in zip(c.agents, c.versions))

    def batch_for(self, version: int, world_size: int) -> CutBatch | None:
        """The batch for `version`, cutting it if enough slices are buffered."""
        if version in self.cut:
            return self.cut[version]
        if len(self.slices) < self.batch_groups:
            return None
        slices = [self.slices.popleft() for _ in range(self.batch_groups)]
        samples = batch_samples(slices, self.adv)
        batch = CutBatch(
            model=self.model,
            version=version,
            slices=slices,
            samples=samples,
            shards=shard(self.model, version, samples, world_size),
            stats=batch_stats(slices, samples, version, self.stale)
            | variation_stats(slices, samples),
        )
        self.cut[version] = batch
        self.batches_cut += 1
        return batch

    def refusal(self, rank: int, version: int, current: int) -> str:
        """Why rank `rank` may not ask for the batch of `version` while the model is at
        `current` ("" = it may; the gate asks). Only rank 0 moves a version. A version the
        model has moved past is served only while its batch is still cut: cut again, its
        groups would sit in a batch no learner trains, and the next step report would
        count them as trained."""
        if version < current and version not in self.cut:
            return (
                f"batch for {self.model} v{version}, but {self.model} is at v{current}: that "
                "batch was trained (or never cut) and is not cut again"
            )
        if version > current and rank != 0:
            return (
                f"rank {rank} asks for {self.model} v{version} while it is at v{current}: "
                "only rank 0 moves a version"
            )
        return ""

    def untrained_groups(self) -> dict[int, str]:
        """Group id -> task id of every slice buffered, or cut into a batch not trained yet."""
        parts = [*self.slices, *(p for b in self.cut.values() for p in b.slices)]
        return {p.group_id: p.task.task_id for p in parts}

    def restore(self, version: int) -> None:
        """On resume, for a fresh buffer: the learner continues at `version`, so that many
        batches were cut (the slices themselves are not restored: their tasks are requeued)."""
        self.batches_cut = version

    def trained(self, new_version: int) -> list[CutBatch]:
        """The learner reached `new_version`: batches of older versions are done."""
        done = [b for v, b in self.cut.items() if v < new_version]
        for b in done:
            del self.cut[b.version]
        return done
