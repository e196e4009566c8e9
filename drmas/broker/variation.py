"""Which agents' scores vary in a group, and why: per-batch diagnostics and the
zero-variance filter (issue #24; docs/algorithm.md, "Steadier agent statistics").

Agent-wise advantages divide by σ_k, agent k's std over its steps in a group. With a few
steps per group that std is often 0 (no signal), comes only from the invalid-action
penalty (a 0.1 difference normalised to unit size), or is undefined (a lone step, which
the reference leaves uncentred: advantage = score). The broker's batch cut
(drmas/broker/buffers.py) adds `variation_stats` to each step's metrics line so spike
steps can be matched with these cases. BrokerState (drmas/broker/state.py) asks
`ZeroVarianceFilter` at intake whether a group carries any signal at all
(`algorithm.skip_zero_variance`). Pure logic: reads a group's step columns, nothing else.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

from drmas.protocol.messages import Sample

if TYPE_CHECKING:
    from drmas.broker.buffers import GroupSlice, StepColumns
    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.broker")


class AgentVariation(NamedTuple):
    """One agent in one group."""

    steps: int  # its steps in the group (every call of every episode)
    varying: bool  # its scores are not all equal: σ_k > 0
    penalty_only: bool  # they vary, but its rewards do not: only the penalty moves them


def agent_variation(columns: StepColumns) -> dict[str, AgentVariation]:
    """Per agent of `columns` (a whole group, or one model's slice of it): whether its
    scores vary, and whether only through the invalid-action penalty. Exact comparisons:
    equal scores are a zero std, however the mean rounds."""
    scores: dict[str, list[float]] = collections.defaultdict(list)
    rewards: dict[str, list[float]] = collections.defaultdict(list)
    for agent, score, reward in zip(columns.agents, columns.scores, columns.rewards):
        scores[agent].append(score)
        rewards[agent].append(reward)
    out = {}
    for agent, s in scores.items():
        varying = max(s) > min(s)
        reward_varies = max(rewards[agent]) > min(rewards[agent])
        out[agent] = AgentVariation(len(s), varying, varying and not reward_varies)
    return out


def no_variance(columns: StepColumns) -> bool:
    """True when no agent's scores vary in this group (a lone step does not vary)."""
    return not any(v.varying for v in agent_variation(columns).values())


def variation_stats(slices: Sequence[GroupSlice], samples: Sequence[Sample]) -> dict[str, float]:
    """One model's batch, per agent: in how many of its groups the agent acts
    (`groups_acting/<agent>`), acts once (`groups_lone/<agent>`: advantage = its score,
    uncentred), has scores that vary (`groups_varying/<agent>`: σ_k > 0), vary only
    through the penalty (`groups_penalty_only/<agent>`); and its largest |advantage|
    (`advantage/<agent>/max_abs`). A slice holds every step of its model's agents in the
    group, so an agent's counts are over its whole groups."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for sl in slices:
        for agent, v in agent_variation(sl.columns).items():
            c = counts[agent]
            c["acting"] += 1
            c["lone"] += v.steps == 1
            c["varying"] += v.varying
            c["penalty_only"] += v.penalty_only
    largest: dict[str, float] = collections.defaultdict(float)
    for sample in samples:
        largest[sample.agent] = max(largest[sample.agent], abs(sample.advantage))
    stats: dict[str, float] = {}
    for agent, c in counts.items():
        for what in ("acting", "lone", "varying", "penalty_only"):
            stats[f"groups_{what}/{agent}"] = float(c[what])
        stats[f"advantage/{agent}/max_abs"] = largest.get(agent, 0.0)
    return stats


class ZeroVarianceFilter:
    """`algorithm.skip_zero_variance`: a group in which no agent's scores vary is left out
    before it reaches any model's buffer, so every model skips the same groups and the
    batches fill from later groups. With `algorithm.zero_variance_by=model` each model
    decides on its own slice instead: it leaves the slice out when none of its own agents'
    scores vary (a model whose agents tie would otherwise train on advantages that are all
    zero), counted in `counters["zero_variance_slices_skipped/<model>"]`; a group that no
    model keeps counts as skipped too. Decided at intake, not at the cut: the property is the
    whole group's and fixed once it is scored, and a slice that would be thrown away later
    must not count against admission control ((η + 1)·B buffered) or the groups still
    needed. The group stays accepted (its lease ended well) and is never trained; its task
    is not requeued: its outcome is known (every episode tied), and sampling it again would
    mostly tie again and skew the task order towards all-solved and none-solved tasks.
    Counted in `counters["zero_variance_groups_skipped"]`."""

    def __init__(self, cfg: DrmasConfig, counters: collections.Counter[str]) -> None:
        self.enabled = cfg.algorithm.skip_zero_variance
        self.by_model = cfg.algorithm.zero_variance_by == "model"
        self.warn_every = 10 * cfg.batch_groups
        self.counters = counters
        self.streak = 0  # groups skipped in a row

    def kept(self, slices: Mapping[str, GroupSlice]) -> Mapping[str, GroupSlice]:
        """The slices of a group to buffer (counted): all of them, none, or (by model) the
        slices of the models some of whose own agents' scores vary."""
        if not self.enabled:
            return slices
        if not self.by_model:
            return {} if self.skip(slices) else slices
        keep = {m: part for m, part in slices.items() if not no_variance(part.columns)}
        for model in slices.keys() - keep.keys():
            self.counters[f"zero_variance_slices_skipped/{model}"] += 1
        if keep:
            self.streak = 0
        else:
            self._skipped()
        return keep

    def skip(self, slices: Mapping[str, GroupSlice]) -> bool:
        """True (and counted) when the group these slices share is to be left out."""
        if not self.enabled:
            return False
        first = next(iter(slices.values()), None)  # every slice shares the whole group
        if first is not None and not no_variance(first.group.columns):
            self.streak = 0
            return False
        self._skipped()
        return True

    def _skipped(self) -> None:
        """A group no model trains: counted, and a long run of them logged."""
        self.counters["zero_variance_groups_skipped"] += 1
        self.streak += 1
        if self.streak % self.warn_every == 0:
            log.warning(
                "the last %d groups had no agent whose scores vary and were all skipped "
                "(algorithm.skip_zero_variance): training waits for a group with a signal. "
                "Check the team's rewards, or set algorithm.skip_zero_variance=false",
                self.streak,
            )
