"""Each step's reward and score, as every consumer of a group computes them.

A step's **reward** is its own `Step.reward` when the team set one (a role reward: the
verifier paid for its verdict, the searcher for what it retrieved), else the episode's
team reward. Its **score** is that reward minus `algorithm.invalid_action_penalty` when
its action did not parse, times its agent's `workflow.reward_scale` (1 unless set: an agent
paid in other units). Scores are what the advantage modes normalise
(drmas/broker/advantages.py; definitions in docs/algorithm.md).

Used by the broker's batch cut (drmas/broker/buffers.py) and transcripts
(drmas/broker/samples.py), by `drmas eval` (per-agent mean step rewards) and by `drmas
probe`, so the learners, the logs and the probe all score a step the same way. Works on
the wire's headers (EpisodeHeader / StepHeader) and on the actor's Episodes / Steps alike.
When no step sets its own reward the scores are the team reward minus the penalty, bit for
bit as before per-step rewards existed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class _StepLike(Protocol):
    @property
    def agent(self) -> str: ...

    @property
    def reward(self) -> float | None: ...

    @property
    def valid(self) -> bool: ...


class _EpisodeLike(Protocol):
    @property
    def reward(self) -> float: ...

    @property
    def steps(self) -> Sequence[_StepLike]: ...


def step_rewards(episodes: Sequence[_EpisodeLike]) -> list[float]:
    """Every step's reward, episode by episode: its own, or its episode's team reward."""
    return [e.reward if s.reward is None else s.reward for e in episodes for s in e.steps]


def step_scores(
    episodes: Sequence[_EpisodeLike], penalty: float, scale: Mapping[str, float] | None = None
) -> tuple[list[float], list[float]]:
    """(rewards, scores) of every step, episode by episode: score = reward, minus `penalty`
    for a step whose action did not parse, times `scale` of the step's agent (1 if absent).
    The rewards are the team's own pay, unscaled."""
    rewards = step_rewards(episodes)
    valid = [s.valid for e in episodes for s in e.steps]
    scores = [r if v else r - penalty for r, v in zip(rewards, valid)]
    if scale:
        agents = [s.agent for e in episodes for s in e.steps]
        scores = [x * scale.get(a, 1.0) for x, a in zip(scores, agents)]
    return rewards, scores
