"""Per-model step buffers and batch cutting (pure logic, no sockets).

A finished group is scored and turned into advantages once (drmas/broker/advantages.py),
then split into one *slice* per model: the steps of the agents bound to that model.
Each model's learner takes batches of `batch_groups` slices. Staleness is checked when a
batch is cut; a slice that is too stale is dropped and reported to the caller.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np

from drmas.broker.advantages import compute_advantages
from drmas.broker.config import AdvantageConfig
from drmas.protocol.arrays import unpack_ids
from drmas.protocol.messages import BatchShard, Episode, Sample, Task


@dataclass
class GroupSlice:
    """The steps of one group that train one model."""

    group_id: int
    task: Task
    samples: list[Sample]
    scores: list[float]  # step score per sample (team reward minus its penalty)
    rewards: list[float]  # episode team reward per sample
    episode_ids: list[int]  # episode index within the group per sample

    @property
    def min_version(self) -> int:
        return min(s.version for s in self.samples)


@dataclass
class CutBatch:
    """One model's batch for one learner version, split into equal rank shards."""

    model: str
    version: int
    slices: list[GroupSlice]
    shards: list[BatchShard]
    stats: dict[str, float] = field(default_factory=dict)


def score_group(
    episodes: list[Episode], penalty: float
) -> tuple[list[tuple[int, int]], np.ndarray]:
    """Step scores = episode team reward minus penalty for an unparsed action (reference)."""
    index = [(e, s) for e, ep in enumerate(episodes) for s in range(len(ep.steps))]
    scores = np.array(
        [episodes[e].reward - penalty * (not episodes[e].steps[s].valid) for e, s in index],
        dtype=np.float64,
    )
    return index, scores


def split_group(
    group_id: int,
    task: Task,
    episodes: list[Episode],
    agent_models: dict[str, str],
    adv: AdvantageConfig,
    penalty: float,
) -> dict[str, GroupSlice]:
    """Score a group, compute its advantages (scope=group) and split it per model."""
    index, scores = score_group(episodes, penalty)
    agents = [episodes[e].steps[s].agent for e, s in index]
    advantages = compute_advantages(
        scores,
        np.zeros(len(index), dtype=np.int64),
        np.array([e for e, _ in index]),
        agents,
        mode=adv.mode,
        norm_by_std=adv.norm_by_std,
        eps=adv.eps,
        std=adv.std,
        scope="group",
    )
    slices: dict[str, GroupSlice] = {}
    for (e, s), score, advantage in zip(index, scores, advantages):
        step = episodes[e].steps[s]
        model = agent_models[step.agent]
        part = slices.setdefault(model, GroupSlice(group_id, task, [], [], [], []))
        part.samples.append(
            Sample(
                agent=step.agent,
                prompt_ids=step.prompt_ids,
                response_ids=step.response_ids,
                logprobs=step.logprobs,
                advantage=float(advantage),
                version=step.version,
            )
        )
        part.scores.append(float(score))
        part.rewards.append(episodes[e].reward)
        part.episode_ids.append(e)
    return slices


def rebatch_advantages(slices: list[GroupSlice], adv: AdvantageConfig) -> None:
    """scope=batch: recompute advantages per agent over the whole batch (in place)."""
    samples = [s for sl in slices for s in sl.samples]
    scores = np.array([x for sl in slices for x in sl.scores])
    episode_ids = np.array([sl.group_id * 1_000_003 + e for sl in slices for e in sl.episode_ids])
    advantages = compute_advantages(
        scores,
        np.zeros(len(samples), dtype=np.int64),
        episode_ids,
        [s.agent for s in samples],
        mode=adv.mode,
        norm_by_std=adv.norm_by_std,
        eps=adv.eps,
        std=adv.std,
        scope="batch",
    )
    for sample, value in zip(samples, advantages):
        sample.advantage = float(value)


def shard(model: str, version: int, samples: list[Sample], world_size: int) -> list[BatchShard]:
    """Split samples over ranks with equal counts (padding copies get weight 0).

    Samples are dealt longest-first round-robin so ranks get similar token counts.
    """
    total_tokens = sum(len(unpack_ids(s.response_ids)) for s in samples)
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


def batch_stats(slices: list[GroupSlice], version: int) -> dict[str, float]:
    """Per-agent reward/score/advantage statistics and staleness of one batch."""
    by_agent: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    staleness = []
    for sl in slices:
        for sample, score, reward in zip(sl.samples, sl.scores, sl.rewards):
            by_agent[sample.agent].append((reward, score, sample.advantage))
            staleness.append(version - sample.version)
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
    """FIFO of group slices for one model, and the batches cut from it."""

    def __init__(self, model: str, batch_groups: int, max_staleness: int, adv: AdvantageConfig):
        self.model = model
        self.batch_groups = batch_groups
        self.max_staleness = max_staleness
        self.adv = adv
        self.slices: collections.deque[GroupSlice] = collections.deque()
        self.cut: dict[int, CutBatch] = {}  # learner version -> batch (until it reports)
        self.batches_cut = 0

    def add(self, part: GroupSlice) -> None:
        self.slices.append(part)

    def drop_stale(self, version: int) -> list[GroupSlice]:
        """Remove slices that would train `version` more than max_staleness after they were made."""
        keep: collections.deque[GroupSlice] = collections.deque()
        dropped: list[GroupSlice] = []
        for part in self.slices:
            (dropped if version - part.min_version > self.max_staleness else keep).append(part)
        self.slices = keep
        return dropped

    def batch_for(self, version: int, world_size: int) -> CutBatch | None:
        """The batch for `version`, cutting it if enough slices are buffered."""
        if version in self.cut:
            return self.cut[version]
        if len(self.slices) < self.batch_groups:
            return None
        slices = [self.slices.popleft() for _ in range(self.batch_groups)]
        if self.adv.scope == "batch":
            rebatch_advantages(slices, self.adv)
        samples = [s for sl in slices for s in sl.samples]
        batch = CutBatch(
            model=self.model,
            version=version,
            slices=slices,
            shards=shard(self.model, version, samples, world_size),
            stats=batch_stats(slices, version),
        )
        self.cut[version] = batch
        self.batches_cut += 1
        return batch

    def trained(self, new_version: int) -> list[CutBatch]:
        """The learner reached `new_version`: batches of older versions are done."""
        done = [b for v, b in self.cut.items() if v < new_version]
        for b in done:
            del self.cut[b.version]
        return done
