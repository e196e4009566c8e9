"""Step scores -> advantages, per prompt group (DESIGN.md §1). Pure numpy: the broker runs it
on every completed group, so everything is vectorised with ``np.unique`` + ``np.bincount``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

Float = NDArray[np.float64]
Index = NDArray[np.intp]

_STD_DDOF = {"unbiased": 1, "population": 0}
_SCOPES = ("group", "batch")


@dataclass
class _Steps:
    """The input as dense indices: one entry per step."""

    score: Float  # [N] step scores
    group: Index  # [N] group index in [0, num_groups)
    episode: Index  # [N] episode index in [0, num_episodes), episodes never shared by groups
    agent: Index  # [N] (group, agent) index in [0, num_group_agents)
    ddof: int


def _stats(keys: Index, values: Float, num_keys: int, ddof: int) -> tuple[Float, Float]:
    """Mean and std of ``values`` per key; a key with a single value gets mean 0, std 1
    (reference behaviour: a lone sample is not centred)."""
    count = np.bincount(keys, minlength=num_keys).astype(np.float64)  # [K]
    mean = np.bincount(keys, weights=values, minlength=num_keys) / count  # [K]
    # Two-pass variance: exact for scores that are large relative to their spread.
    sq = np.bincount(keys, weights=(values - mean[keys]) ** 2, minlength=num_keys)  # [K]
    lone = count <= 1
    std = np.sqrt(sq / np.where(lone, 1.0, count - ddof))
    return np.where(lone, 0.0, mean), np.where(lone, 1.0, std)


def _global(steps: _Steps) -> tuple[Float, Float, Float]:
    """(value, centre, scale) per step with the group's statistics over its episode means."""
    num_episodes = int(steps.episode.max()) + 1
    count = np.bincount(steps.episode, minlength=num_episodes)
    episode_mean = np.bincount(steps.episode, weights=steps.score, minlength=num_episodes) / count
    # Every step of an episode carries the same group index; pick one per episode.
    episode_group = np.empty(num_episodes, dtype=np.intp)
    episode_group[steps.episode] = steps.group
    mean, std = _stats(episode_group, episode_mean, int(steps.group.max()) + 1, steps.ddof)
    return episode_mean[steps.episode], mean[steps.group], std[steps.group]


def _per_agent(steps: _Steps) -> tuple[Float, Float]:
    mean, std = _stats(steps.agent, steps.score, int(steps.agent.max()) + 1, steps.ddof)
    return mean[steps.agent], std[steps.agent]


def _mode_global(steps: _Steps) -> tuple[Float, Float, Float]:
    return _global(steps)


def _mode_agent(steps: _Steps) -> tuple[Float, Float, Float]:
    mean_k, std_k = _per_agent(steps)
    return steps.score, mean_k, std_k


def _mode_agent_mean(steps: _Steps) -> tuple[Float, Float, Float]:
    _, _, std = _global(steps)
    mean_k, _ = _per_agent(steps)
    return steps.score, mean_k, std


def _mode_agent_std(steps: _Steps) -> tuple[Float, Float, Float]:
    _, mean, _ = _global(steps)
    _, std_k = _per_agent(steps)
    return steps.score, mean, std_k


def _mode_step_global(steps: _Steps) -> tuple[Float, Float, Float]:
    mean, std = _stats(steps.group, steps.score, int(steps.group.max()) + 1, steps.ddof)
    return steps.score, mean[steps.group], std[steps.group]


# mode -> (value, centre, scale) of every step; advantage = (value - centre) / (scale + eps).
_MODES: dict[str, Callable[[_Steps], tuple[Float, Float, Float]]] = {
    "global": _mode_global,
    "agent": _mode_agent,
    "agent_mean": _mode_agent_mean,
    "agent_std": _mode_agent_std,
    "step_global": _mode_step_global,
}


def _dense(values: NDArray[np.generic]) -> Index:
    return np.unique(values, return_inverse=True)[1].reshape(-1).astype(np.intp)


def _pair(a: Index, b: Index) -> Index:
    """Dense index of the pairs (a[i], b[i])."""
    return _dense(a.astype(np.int64) * (int(b.max()) + 1) + b)


def _one_dim(name: str, values: ArrayLike, n: int | None) -> NDArray[np.generic]:
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one entry per step), got shape {array.shape}")
    if n is not None and array.shape[0] != n:
        raise ValueError(
            f"{name} has {array.shape[0]} entries but scores has {n}: pass one entry per step"
        )
    return array


def compute_advantages(
    scores: ArrayLike,
    group_ids: ArrayLike,
    episode_ids: ArrayLike,
    agent_ids: Sequence[str] | ArrayLike,
    *,
    mode: str = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    std: str = "unbiased",
    scope: str = "group",
) -> np.ndarray:
    """One advantage per step (float64), to be broadcast to the step's response tokens.

    Why agent-wise (Dr. MAS, Lemma 4.2): normalising agent k's scores with the team's μ, σ
    scales its gradient's second moment by (σ_k² + (μ_k − μ)²)/σ², which explodes when the
    agent's reward distribution drifts from the team's; its own μ_k, σ_k make that factor 1.

    Modes: ``global`` (vanilla GRPO: every step gets its episode's (R̄_i − μ)/(σ+ε)),
    ``agent`` (default, (s − μ_k)/(σ_k+ε)), ``agent_mean`` ((s − μ_k)/(σ+ε)), ``agent_std``
    ((s − μ)/(σ_k+ε)), ``step_global`` ((s − μ_all)/(σ_all+ε) over every step of the group).
    Global statistics μ, σ = over the group's episode means, as in ``global``; agent
    statistics μ_k, σ_k = over every call of agent k in the group (several calls of one
    episode count separately), as the reference's (uid, agent) key does. A statistic over a
    single sample is mean 0, std 1, as in the reference. ``std`` is ``unbiased`` (n − 1,
    torch.std) or ``population`` (n); ``norm_by_std=False`` returns value − centre.
    ``scope="batch"`` ignores ``group_ids`` and treats the whole input as one group. Episodes
    are identified by (group id, episode id), so episode ids need only be unique per group.
    """
    if mode not in _MODES:
        raise ValueError(f"unknown advantage mode {mode!r}: use one of {sorted(_MODES)}")
    if std not in _STD_DDOF:
        raise ValueError(f"unknown std {std!r}: use one of {sorted(_STD_DDOF)}")
    if scope not in _SCOPES:
        raise ValueError(f"unknown scope {scope!r}: use one of {list(_SCOPES)}")
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")

    raw = _one_dim("scores", scores, None)
    n = raw.shape[0]
    if not np.issubdtype(raw.dtype, np.number) or np.issubdtype(raw.dtype, np.complexfloating):
        raise ValueError(f"scores must be real numbers, got dtype {raw.dtype}")
    score: Float = raw.astype(np.float64)
    if not np.all(np.isfinite(score)):
        bad = np.flatnonzero(~np.isfinite(score))[:5].tolist()
        raise ValueError(f"scores must be finite; non-finite at steps {bad}: fix the reward")
    groups = _one_dim("group_ids", group_ids, n)
    episodes = _one_dim("episode_ids", episode_ids, n)
    agents = _one_dim("agent_ids", agent_ids, n)
    for name, ids in (("group_ids", groups), ("episode_ids", episodes)):
        if n and not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must be integers, got dtype {ids.dtype}")
    if n == 0:
        return np.zeros(0, dtype=np.float64)

    group = np.zeros(n, dtype=np.intp) if scope == "batch" else _dense(groups)
    # Episodes keyed by (group id, episode id): ids repeated across groups stay distinct.
    episode = _pair(_dense(groups), _dense(episodes))
    steps = _Steps(
        score=score,
        group=group,
        episode=episode,
        agent=_pair(group, _dense(agents.astype(str))),
        ddof=_STD_DDOF[std],
    )
    value, centre, scale = _MODES[mode](steps)
    if not norm_by_std:
        return value - centre
    return (value - centre) / (scale + eps)
