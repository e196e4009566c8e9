"""Step scores -> advantages, per prompt group: vanilla GRPO and the Dr. MAS agent-wise
modes (the formulas and why they matter: docs/algorithm.md, "Advantages").

Called by the broker when it cuts a batch (drmas/broker/buffers.py), by the transcript
writer (drmas/broker/samples.py) and by `drmas probe`. Pure numpy: the broker runs it on
every batch, so everything is vectorised with ``np.unique`` + ``np.bincount``.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence

import numpy as np
from numpy.typing import ArrayLike, NDArray

from drmas.config.types import AdvantageMode, Scope, StdKind, StdPool

Float = NDArray[np.float64]
Index = NDArray[np.intp]

_STD_DDOF: dict[StdKind, int] = {"unbiased": 1, "population": 0}
_SCOPES: tuple[Scope, ...] = ("group", "batch")
_POOLS: tuple[StdPool, ...] = ("group", "batch")


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


def _pooled_std(cell: Index, name: Index, values: Float, mean: Float, ddof: int) -> Float:
    """Per step: its agent's std around the per-cell means, pooled over every cell.

    ``cell`` is the step's (group, agent) index, ``name`` its agent, ``mean`` its cell's
    mean. Agent k's variance is Σ (s − μ_gk)² over its steps / Σ (n_gk − ddof) over its
    cells with n_gk >= 2 (unbiased: the classical pooled within-group variance; one group:
    exactly the per-group std). A lone step keeps std 1 (as in `_stats`) and adds nothing.
    """
    num_cells = int(cell.max()) + 1
    count = np.bincount(cell, minlength=num_cells)  # [C]
    lone = (count <= 1)[cell]  # [N]
    num_names = int(name.max()) + 1
    sq = np.bincount(name, weights=np.where(lone, 0.0, (values - mean) ** 2), minlength=num_names)
    cell_name = np.empty(num_cells, dtype=np.intp)  # [C] the agent of each cell
    cell_name[cell] = name
    dof = np.bincount(
        cell_name, weights=np.where(count > 1, count - ddof, 0).astype(np.float64),
        minlength=num_names,
    )  # fmt: skip
    std = np.sqrt(sq / np.where(dof > 0, dof, 1.0))  # [num_names]
    return np.where(lone, 1.0, std[name])


class _Steps:
    """The input as dense indices, one entry per step, and the statistics the modes combine
    (each computed once, when a mode first asks for it)."""

    def __init__(self, s: Float, group: Index, episode: Index, name: Index, ddof: int) -> None:
        self.s = s  # [N] step scores
        self.group = group  # [N] group index in [0, num_groups)
        self.episode = episode  # [N] episode index; episodes are never shared by groups
        self.name = name  # [N] agent name index
        self.agent = _pair(group, name)  # [N] (group, agent) index in [0, num_group_agents)
        self.ddof = ddof
        # agent_std_pool=batch: the agent (name) index of every step; None: σ_k per group
        self.pool_by: Index | None = None

    @functools.cached_property
    def _team(self) -> tuple[Float, Float, Float]:
        """Per step: R̄_i, the mean score of its episode; μ, σ over its group's episode means."""
        num_episodes = int(self.episode.max()) + 1
        count = np.bincount(self.episode, minlength=num_episodes)
        episode_mean = np.bincount(self.episode, weights=self.s, minlength=num_episodes) / count
        # Every step of an episode carries the same group index; pick one per episode.
        episode_group = np.empty(num_episodes, dtype=np.intp)
        episode_group[self.episode] = self.group
        mean, std = _stats(episode_group, episode_mean, int(self.group.max()) + 1, self.ddof)
        return episode_mean[self.episode], mean[self.group], std[self.group]

    @functools.cached_property
    def _agent(self) -> tuple[Float, Float]:
        """Per step: μ_k, σ_k over every call of its agent k in its group (σ_k pooled over
        every group of the input when `pool_by` is set; μ_k stays the group's)."""
        mean, std = _stats(self.agent, self.s, int(self.agent.max()) + 1, self.ddof)
        if self.pool_by is None:
            return mean[self.agent], std[self.agent]
        mu_k = mean[self.agent]
        return mu_k, _pooled_std(self.agent, self.pool_by, self.s, mu_k, self.ddof)

    @functools.cached_property
    def turn(self) -> Index:
        """Per step: which call of its agent in its episode it is (0 for the first), in the
        order the steps are given (an episode's steps in the order they were taken)."""
        n = self.s.shape[0]
        calls = _pair(self.episode, self.name)  # [N] (episode, agent)
        order = np.argsort(calls, kind="stable")
        ranked = calls[order]
        first = np.r_[True, ranked[1:] != ranked[:-1]]
        start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
        turn = np.empty(n, dtype=np.intp)
        turn[order] = np.arange(n) - start
        return turn

    @functools.cached_property
    def _agent_turn(self) -> tuple[Float, Float]:
        """Per step: μ_kt, σ_kt over the calls of its agent k at the same turn t across its
        group's episodes (AT-GRPO's agent-and-turn groups). A step alone in its cell (only
        one episode reached that call) falls back to its agent's μ_k, σ_k."""
        cell = _pair(self.agent, self.turn)
        num_cells = int(cell.max()) + 1
        mean, std = _stats(cell, self.s, num_cells, self.ddof)
        lone = np.bincount(cell, minlength=num_cells)[cell] <= 1
        return np.where(lone, self.mu_k, mean[cell]), np.where(lone, self.sigma_k, std[cell])

    @functools.cached_property
    def _pooled(self) -> tuple[Float, Float]:
        """Per step: μ_all, σ_all over every step of its group, whatever the agent."""
        mean, std = _stats(self.group, self.s, int(self.group.max()) + 1, self.ddof)
        return mean[self.group], std[self.group]

    @property
    def episode_mean(self) -> Float:
        return self._team[0]

    @property
    def mu(self) -> Float:
        return self._team[1]

    @property
    def sigma(self) -> Float:
        return self._team[2]

    @property
    def mu_k(self) -> Float:
        return self._agent[0]

    @property
    def sigma_k(self) -> Float:
        return self._agent[1]

    @property
    def mu_kt(self) -> Float:
        return self._agent_turn[0]

    @property
    def sigma_kt(self) -> Float:
        return self._agent_turn[1]

    @property
    def mu_all(self) -> Float:
        return self._pooled[0]

    @property
    def sigma_all(self) -> Float:
        return self._pooled[1]


# mode -> (value, centre, scale) of every step; advantage = (value − centre) / (scale + ε).
_MODES: dict[AdvantageMode, Callable[[_Steps], tuple[Float, Float, Float]]] = {
    "global": operator.attrgetter("episode_mean", "mu", "sigma"),  # (R̄_i − μ)/(σ + ε): GRPO
    "agent": operator.attrgetter("s", "mu_k", "sigma_k"),  # (s − μ_k)/(σ_k + ε): Dr. MAS
    "agent_mean": operator.attrgetter("s", "mu_k", "sigma"),  # (s − μ_k)/(σ + ε)
    "agent_std": operator.attrgetter("s", "mu", "sigma_k"),  # (s − μ)/(σ_k + ε)
    "step_global": operator.attrgetter("s", "mu_all", "sigma_all"),  # (s − μ_all)/(σ_all + ε)
    "agent_turn": operator.attrgetter("s", "mu_kt", "sigma_kt"),  # (s − μ_kt)/(σ_kt + ε)
    # step_global = (σ_k/σ_all)·agent + (μ_k − μ_all)/σ_all: a rescaling plus an offset.
    # These two take one part away each (a 2 x 2 with agent and step_global):
    "agent_centred": operator.attrgetter("s", "mu_k", "sigma_all"),  # (s − μ_k)/(σ_all + ε)
    # agent + (μ_k − μ_all)/(σ_all + ε), step_global's offset: `_shifted`
    "agent_shifted": operator.attrgetter("s", "mu_k", "sigma_k"),
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


def _choice(what: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}: use one of {sorted(allowed)}")


def _steps_of(
    scores: ArrayLike, group_ids: ArrayLike, episode_ids: ArrayLike, agent_ids: ArrayLike,
    ddof: int, scope: Scope,
) -> _Steps | None:  # fmt: skip
    """The validated input as dense indices (None: no steps)."""
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
        return None
    group = np.zeros(n, dtype=np.intp) if scope == "batch" else _dense(groups)
    # Episodes keyed by (group id, episode id): ids repeated across groups stay distinct.
    episode = _pair(_dense(groups), _dense(episodes))
    return _Steps(score, group, episode, _dense(agents.astype(str)), ddof)


def _shifted(steps: _Steps, norm_by_std: bool, eps: float, std_floor: float) -> Float:
    """agent_shifted: agent's (s − μ_k)/(σ_k + ε) plus step_global's offset."""
    value, mu_k, sigma_k = _MODES["agent"](steps)
    mu_all, sigma_all = steps.mu_all, steps.sigma_all
    if not norm_by_std:
        return value - mu_all
    if std_floor > 0:
        sigma_k, sigma_all = np.maximum(sigma_k, std_floor), np.maximum(sigma_all, std_floor)
    return (value - mu_k) / (sigma_k + eps) + (mu_k - mu_all) / (sigma_all + eps)


def compute_advantages(
    scores: ArrayLike,
    group_ids: ArrayLike,
    episode_ids: ArrayLike,
    agent_ids: Sequence[str] | ArrayLike,
    *,
    mode: AdvantageMode = "agent",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    std: StdKind = "unbiased",
    scope: Scope = "group",
    agent_std_pool: StdPool = "group",
    std_floor: float = 0.0,
) -> np.ndarray:
    """One advantage per step (float64), to be broadcast to the step's response tokens.

    Why agent-wise (Dr. MAS, Lemma 4.2): normalising agent k's scores with the team's μ, σ
    scales its gradient's second moment by (σ_k² + (μ_k − μ)²)/σ², which explodes when the
    agent's reward distribution drifts from the team's; its own μ_k, σ_k make that factor 1.

    `mode` picks (value, centre, scale) from `_MODES`. Team statistics μ, σ = over the
    group's episode means R̄_i; agent statistics μ_k, σ_k = over every call of agent k in
    the group (several calls of one episode count separately), as the reference's
    (uid, agent) key does. Agent-and-turn statistics μ_kt, σ_kt (mode agent_turn) = over
    the t-th calls of agent k in the group's episodes, the steps of an episode given in
    the order they were taken; a cell of one step falls back to μ_k, σ_k. A statistic
    over a single sample is mean 0, std 1, as in the reference. ``std`` is ``unbiased`` (n − 1, torch.std) or ``population`` (n);
    ``norm_by_std=False`` returns value − centre. ``scope="batch"`` ignores ``group_ids``
    and treats the whole input as one group. Episodes are identified by (group id,
    episode id), so episode ids need only be unique per group.

    Small-sample options (docs/algorithm.md, "Steadier agent statistics"):
    ``agent_std_pool="batch"`` takes σ_k (modes agent, agent_std) from agent k's
    group-centred scores pooled over every group of the input, the per-group μ_k kept,
    so an agent with few steps per group gets a std from many; ``std_floor`` > 0 divides
    by max(σ, std_floor) for every σ of the mode, so a difference smaller than the floor
    (e.g. the invalid-action penalty alone) is not blown up to unit size. The defaults
    ("group", 0) give today's numbers bit for bit.
    """
    _choice("advantage mode", mode, list(_MODES))
    _choice("std", std, list(_STD_DDOF))
    _choice("scope", scope, _SCOPES)
    _choice("agent_std_pool", agent_std_pool, _POOLS)
    for name, x in (("eps", eps), ("std_floor", std_floor)):
        if not (np.isfinite(x) and x >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {x!r}")
    steps = _steps_of(scores, group_ids, episode_ids, agent_ids, _STD_DDOF[std], scope)
    if steps is None:
        return np.zeros(0, dtype=np.float64)
    if agent_std_pool == "batch":
        steps.pool_by = _dense(np.asarray(agent_ids).astype(str))
    value, centre, scale = _MODES[mode](steps)
    if mode == "agent_shifted":
        return _shifted(steps, norm_by_std, eps, std_floor)
    if not norm_by_std:
        return value - centre
    if std_floor > 0:
        scale = np.maximum(scale, std_floor)
    return (value - centre) / (scale + eps)
