"""`drmas eval`'s rewards beside its success rates: each agent's mean step reward and the
team's mean reward, per data source and over all tasks.

A team may pay each agent its own reward (Step.reward: the verifier for its verdict, the
searcher for what it retrieved); the task is still the team's, so success (avg@k, pass@k)
stays the episode's team reward >= 1 (drmas/broker/evaluation.py). These columns say how
each agent earns its own pay on held-out tasks. A step without its own reward counts the
episode's team reward, as in training (drmas/broker/scores.py).

Called by drmas/launch/evaluate.py: `episode_rewards` while sampling, `reward_columns`
per table, `format_rewards` for the printed line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import sqrt
from typing import Any, NamedTuple

from drmas.broker.scores import step_rewards
from drmas.protocol.messages import Episode, Task

TEAM_KEY = "team_reward"
"""The mean episode (team) reward, with `team_reward/se`."""


class TaskResult(NamedTuple):
    """One task's n episodes: team rewards (a success is >= 1), the team's episode metrics,
    and each episode's step rewards by agent (empty when not recorded)."""

    task: Task
    rewards: list[float]
    metrics: list[dict[str, float]]
    agent_rewards: Sequence[Mapping[str, Sequence[float]]] = ()


def episode_rewards(episode: Episode) -> dict[str, list[float]]:
    """Agent -> the rewards of its steps in this episode (own, else the team reward)."""
    out: dict[str, list[float]] = {}
    for step, reward in zip(episode.steps, step_rewards([episode])):
        out.setdefault(step.agent, []).append(reward)
    return out


def reward_columns(rows: Sequence[TaskResult]) -> dict[str, float]:
    """`team_reward` (mean over episodes) and `reward/<agent>` (mean over all the agent's
    steps), each with `/se`, its standard error over tasks (the tasks are independent, the
    n samples of one task are not)."""
    team = [(sum(r.rewards), len(r.rewards)) for r in rows]
    out = _ratio_mean(TEAM_KEY, team)
    agents = sorted({a for r in rows for episode in r.agent_rewards for a in episode})
    for agent in agents:
        per_task = [
            (
                sum(sum(e.get(agent, ())) for e in r.agent_rewards),
                sum(len(e.get(agent, ())) for e in r.agent_rewards),
            )
            for r in rows
        ]
        out |= _ratio_mean(f"reward/{agent}", per_task)
    return out


def _ratio_mean(key: str, per_task: Sequence[tuple[float, int]]) -> dict[str, float]:
    """The mean over every value (sum of sums / sum of counts) and its standard error over
    tasks, linearised as for a ratio estimator: sqrt(Σ_t d_t² / (T (T − 1))) with
    d_t = (S_t − m N_t) / N̄. With the same count in every task this is exactly the
    standard error of the per-task means; a task where the agent never acted has d_t = 0.
    Empty when no task has a value; se 0 for fewer than two tasks."""
    total = sum(n for _, n in per_task)
    if total == 0:
        return {}
    tasks = len(per_task)
    mean = sum(s for s, _ in per_task) / total
    count_mean = total / tasks
    se = 0.0
    if tasks > 1:
        d2 = sum(((s - mean * n) / count_mean) ** 2 for s, n in per_task)
        se = sqrt(d2 / (tasks * (tasks - 1)))
    return {key: mean, f"{key}/se": se}


def format_rewards(overall: Mapping[str, Any]) -> str:
    """One line: each agent's mean step reward and the team's mean reward (± se); empty
    when the report has none."""
    agents = sorted(
        k.removeprefix("reward/") for k in overall if k.startswith("reward/") and k.count("/") == 1
    )
    if TEAM_KEY not in overall and not agents:
        return ""
    parts = [f"{a} {overall[f'reward/{a}']:.3f} ± {overall[f'reward/{a}/se']:.3f}" for a in agents]
    line = "mean step reward per agent: " + ", ".join(parts) if parts else ""
    if TEAM_KEY in overall:
        team = f"team reward {overall[TEAM_KEY]:.3f} ± {overall[TEAM_KEY + '/se']:.3f}"
        line = f"{line}; {team}" if line else team
    return line
