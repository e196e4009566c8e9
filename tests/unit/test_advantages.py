"""compute_advantages: hand-worked examples, properties, and an independent re-implementation
of the reference's GRPO outcome advantage (verl, keyed by uid or by (uid, agent))."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from drmas.broker.advantages import compute_advantages

torch.set_num_threads(1)

EPS = 1e-6

# ---------------------------------------------------------------------------------------------
# Worked example: one group, two episodes, solver "s" and verifier "v"; the solver is called
# twice per episode.
#   episode 0: s=0, v=2, s=1   -> episode mean R̄_0 = 3/3 = 1
#   episode 1: s=2, v=6, s=1   -> episode mean R̄_1 = 9/3 = 3
# Global (over episode means 1, 3): μ = 2; Σ(d²) = 1 + 1 = 2
#   unbiased σ = sqrt(2/1) = √2 ; population σ = sqrt(2/2) = 1
# Solver (0, 1, 2, 1): μ_s = 4/4 = 1; deviations -1, 0, 1, 0; Σ(d²) = 2
#   unbiased σ_s = sqrt(2/3) ; population σ_s = sqrt(2/4) = sqrt(1/2)
# Verifier (2, 6): μ_v = 4; deviations -2, 2; Σ(d²) = 8
#   unbiased σ_v = sqrt(8/1) = 2√2 ; population σ_v = sqrt(8/2) = 2
# All steps (0, 2, 1, 2, 6, 1): μ_all = 12/6 = 2; deviations -2, 0, -1, 0, 4, -1;
#   Σ(d²) = 4 + 0 + 1 + 0 + 16 + 1 = 22 ; unbiased σ_all = sqrt(22/5) ; population sqrt(22/6)
# ---------------------------------------------------------------------------------------------
SCORES = [0.0, 2.0, 1.0, 2.0, 6.0, 1.0]
GROUPS = [7, 7, 7, 7, 7, 7]
EPISODES = [0, 0, 0, 1, 1, 1]
AGENTS = ["s", "v", "s", "s", "v", "s"]


def _run(**kw: object) -> np.ndarray:
    return compute_advantages(SCORES, GROUPS, EPISODES, AGENTS, **kw)  # type: ignore[arg-type]


def test_global_unbiased() -> None:
    # Every step gets its episode's (R̄_i − 2)/(√2 + ε): episode 0 → −1/√2, episode 1 → +1/√2.
    a = -1 / (math.sqrt(2) + EPS)
    np.testing.assert_allclose(_run(mode="global"), [a, a, a, -a, -a, -a], rtol=1e-12)


def test_global_population() -> None:
    # σ = 1: episode 0 → −1/(1 + ε), episode 1 → +1/(1 + ε).
    a = -1 / (1 + EPS)
    np.testing.assert_allclose(
        _run(mode="global", std="population"), [a, a, a, -a, -a, -a], rtol=1e-12
    )


def test_agent_unbiased_is_default() -> None:
    # Solver: (s − 1)/(√(2/3) + ε) for s = 0, 1, 2, 1 → −u, 0, +u, 0 with u = 1/(√(2/3) + ε).
    # Verifier: (v − 4)/(2√2 + ε) for v = 2, 6 → −w, +w with w = 2/(2√2 + ε).
    u = 1 / (math.sqrt(2 / 3) + EPS)
    w = 2 / (2 * math.sqrt(2) + EPS)
    expected = [-u, -w, 0.0, u, w, 0.0]
    np.testing.assert_allclose(_run(), expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(_run(mode="agent"), expected, rtol=1e-12, atol=1e-15)


def test_agent_population() -> None:
    # Solver σ_s = √(1/2): u = 1/(√0.5 + ε). Verifier σ_v = 2: w = 2/(2 + ε).
    u = 1 / (math.sqrt(0.5) + EPS)
    w = 2 / (2 + EPS)
    np.testing.assert_allclose(
        _run(mode="agent", std="population"), [-u, -w, 0.0, u, w, 0.0], rtol=1e-12, atol=1e-15
    )


def test_agent_mean() -> None:
    # (s − μ_k)/(σ + ε), σ = √2 (global, unbiased): solver (s − 1)/√2, verifier (v − 4)/√2.
    d = math.sqrt(2) + EPS
    expected = [-1 / d, -2 / d, 0.0, 1 / d, 2 / d, 0.0]
    np.testing.assert_allclose(_run(mode="agent_mean"), expected, rtol=1e-12, atol=1e-15)
    # population: σ = 1.
    d = 1 + EPS
    expected = [-1 / d, -2 / d, 0.0, 1 / d, 2 / d, 0.0]
    np.testing.assert_allclose(
        _run(mode="agent_mean", std="population"), expected, rtol=1e-12, atol=1e-15
    )


def test_agent_std() -> None:
    # (s − μ)/(σ_k + ε), μ = 2 (global): solver (s − 2)/(√(2/3) + ε) for 0, 1, 2, 1 →
    # −2, −1, 0, −1 over √(2/3); verifier (v − 2)/(2√2 + ε) for 2, 6 → 0, 4 over 2√2.
    ds = math.sqrt(2 / 3) + EPS
    dv = 2 * math.sqrt(2) + EPS
    expected = [-2 / ds, 0.0, -1 / ds, 0.0, 4 / dv, -1 / ds]
    np.testing.assert_allclose(_run(mode="agent_std"), expected, rtol=1e-12, atol=1e-15)


def test_step_global() -> None:
    # (s − 2)/(σ_all + ε) with deviations −2, 0, −1, 0, 4, −1.
    for kind, var in (("unbiased", 22 / 5), ("population", 22 / 6)):
        d = math.sqrt(var) + EPS
        expected = [-2 / d, 0.0, -1 / d, 0.0, 4 / d, -1 / d]
        np.testing.assert_allclose(
            _run(mode="step_global", std=kind), expected, rtol=1e-12, atol=1e-15
        )


def test_agent_centred_and_agent_shifted_split_step_global_into_rescaling_and_offset() -> None:
    # agent_centred: (s − μ_k)/(σ_all + ε): solver (0, 1, 2, 1) − 1 → −1, 0, 1, 0 and
    # verifier (2, 6) − 4 → −2, 2, all over √(22/5).
    d = math.sqrt(22 / 5) + EPS
    ds = math.sqrt(2 / 3) + EPS
    dv = 2 * math.sqrt(2) + EPS
    centred = [-1 / d, -2 / d, 0.0, 1 / d, 2 / d, 0.0]
    np.testing.assert_allclose(_run(mode="agent_centred"), centred, rtol=1e-12, atol=1e-15)
    # agent_shifted: agent's (s − μ_k)/(σ_k + ε) plus step_global's offset (μ_k − 2)/σ_all:
    # solver offset (1 − 2)/d, verifier (4 − 2)/d.
    shifted = [-1 / ds - 1 / d, -2 / dv + 2 / d, -1 / d, 1 / ds - 1 / d, 2 / dv + 2 / d, -1 / d]
    np.testing.assert_allclose(_run(mode="agent_shifted"), shifted, rtol=1e-12, atol=1e-15)
    # the 2 x 2 adds up: step_global − agent_centred = agent_shifted − agent (the offset)
    np.testing.assert_allclose(
        _run(mode="step_global") - _run(mode="agent_centred"),
        _run(mode="agent_shifted") - _run(mode="agent"),
        rtol=1e-9, atol=1e-12,
    )  # fmt: skip
    # without std normalisation agent_shifted is step_global (s − μ_all)
    np.testing.assert_allclose(
        _run(mode="agent_shifted", norm_by_std=False), _run(mode="step_global", norm_by_std=False)
    )


def test_agent_turn() -> None:
    # Cells (agent, turn): (s, 0) = 0, 2: μ 1, unbiased σ √2; (v, 0) = 2, 6: μ 4, σ 2√2;
    # (s, 1) = 1, 1: μ 1, σ 0 (both Solver second calls scored alike: advantage 0).
    r = 1 / math.sqrt(2)
    expected = [-r, -r, 0.0, r, r, 0.0]
    np.testing.assert_allclose(_run(mode="agent_turn"), expected, rtol=1e-5, atol=1e-12)


def test_agent_turn_falls_back_to_the_agents_statistics_in_a_lone_cell() -> None:
    # Episode 0 calls s three times (1, 3, 5), episode 1 once (3). Cell (s, 0) = 1, 3: μ 2,
    # σ √2. Cells (s, 1) = 3 and (s, 2) = 5 have one step each: they use the Solver's own
    # statistics over 1, 3, 5, 3: μ_s 3, unbiased σ_s = sqrt(8/3).
    out = compute_advantages(
        [1.0, 3.0, 5.0, 3.0], [0, 0, 0, 0], [0, 0, 0, 1], ["s"] * 4, mode="agent_turn"
    )
    sigma_s = math.sqrt(8 / 3)
    expected = [-1 / math.sqrt(2), 0.0, 2 / sigma_s, 1 / math.sqrt(2)]
    np.testing.assert_allclose(out, expected, rtol=1e-5)


def test_agent_turn_counts_calls_per_episode_in_the_given_order() -> None:
    """The turn of a step is its agent's call count so far in its episode: with one call
    per agent per episode, agent_turn is exactly agent (Dr. MAS)."""
    scores, groups, episodes, agents = (
        [0.3, 1.0, 0.7, 0.0, 0.2, 1.0],
        [0] * 6,
        [0, 0, 1, 1, 2, 2],
        ["s", "v"] * 3,
    )
    np.testing.assert_allclose(
        compute_advantages(scores, groups, episodes, agents, mode="agent_turn"),
        compute_advantages(scores, groups, episodes, agents, mode="agent"),
        rtol=1e-12,
    )


def test_no_std_normalisation() -> None:
    # x − μ only.  global: R̄_i − 2 → −1, +1 ; agent: s − μ_k → 0−1, 2−4, 1−1, 2−1, 6−4, 1−1.
    np.testing.assert_allclose(_run(mode="global", norm_by_std=False), [-1, -1, -1, 1, 1, 1])
    np.testing.assert_allclose(_run(mode="agent", norm_by_std=False), [-1, -2, 0, 1, 2, 0])
    # agent_std without std: s − μ = −2, 0, −1, 0, 4, −1 ; step_global: same μ_all = 2.
    np.testing.assert_allclose(_run(mode="agent_std", norm_by_std=False), [-2, 0, -1, 0, 4, -1])
    np.testing.assert_allclose(_run(mode="step_global", norm_by_std=False), [-2, 0, -1, 0, 4, -1])
    # agent_mean without std is agent without std.
    np.testing.assert_allclose(_run(mode="agent_mean", norm_by_std=False), [-1, -2, 0, 1, 2, 0])


def test_custom_eps() -> None:
    # global population: −1/(1 + 0.5) = −2/3.
    out = _run(mode="global", std="population", eps=0.5)
    np.testing.assert_allclose(out, [-2 / 3] * 3 + [2 / 3] * 3)


def test_single_sample_rule() -> None:
    # Group 0 has one episode: s=0.5, v=0.3 (mean 0.4). Every statistic has one sample, so it
    # is mean 0, std 1: global → 0.4/(1 + ε) for both steps; agent → s/(1 + ε).
    scores, groups, episodes, agents = [0.5, 0.3], [0, 0], [0, 0], ["s", "v"]
    np.testing.assert_allclose(
        compute_advantages(scores, groups, episodes, agents, mode="global"),
        [0.4 / (1 + EPS)] * 2,
    )
    np.testing.assert_allclose(
        compute_advantages(scores, groups, episodes, agents, mode="agent"),
        [0.5 / (1 + EPS), 0.3 / (1 + EPS)],
    )
    # The single-sample rule holds for population std too (whose value would be 0).
    np.testing.assert_allclose(
        compute_advantages(scores, groups, episodes, agents, mode="agent", std="population"),
        [0.5 / (1 + EPS), 0.3 / (1 + EPS)],
    )
    # Without std: x − 0 = x.
    np.testing.assert_allclose(
        compute_advantages(scores, groups, episodes, agents, norm_by_std=False), [0.5, 0.3]
    )


def test_single_call_agent_among_many() -> None:
    # Two episodes; the verifier is only called in episode 1 (score 1.0) → its own stats are
    # (0, 1) → 1/(1 + ε). Solver: 0, 1, 1 → μ = 2/3, deviations −2/3, 1/3, 1/3,
    # Σ(d²) = 4/9 + 1/9 + 1/9 = 6/9 ; unbiased σ = sqrt((6/9)/2) = sqrt(1/3).
    out = compute_advantages([0.0, 1.0, 1.0, 1.0], [0] * 4, [0, 1, 1, 1], ["s", "s", "v", "s"])
    d = math.sqrt(1 / 3) + EPS
    np.testing.assert_allclose(out, [(-2 / 3) / d, (1 / 3) / d, 1 / (1 + EPS), (1 / 3) / d])


def test_all_equal_scores_give_zero() -> None:
    # σ = 0 → (s − μ)/(0 + ε) = 0/ε = 0 (every answer equally good: no signal).
    out = compute_advantages([1.0, 1.0, 1.0, 1.0], [0] * 4, [0, 0, 1, 1], ["s", "v", "s", "v"])
    np.testing.assert_allclose(out, [0.0] * 4, atol=1e-9)


def test_groups_are_independent_and_batch_scope_pools() -> None:
    # Two groups, each with one episode that reuses episode id 0 and one solver call:
    # group 0: s=1 ; group 1: s=3.
    scores, groups, episodes, agents = [1.0, 3.0], [0, 1], [0, 0], ["s", "s"]
    # scope=group: each statistic has one sample → s/(1 + ε).
    for mode in ("global", "agent", "step_global"):
        np.testing.assert_allclose(
            compute_advantages(scores, groups, episodes, agents, mode=mode),
            [1 / (1 + EPS), 3 / (1 + EPS)],
        )
    # scope=batch: one pool {1, 3}: μ = 2, unbiased σ = √2 → ∓1/(√2 + ε). The two episodes
    # stay distinct (keyed by group and episode id), so global gives the same.
    d = math.sqrt(2) + EPS
    for mode in ("global", "agent", "step_global", "agent_mean", "agent_std"):
        np.testing.assert_allclose(
            compute_advantages(scores, groups, episodes, agents, mode=mode, scope="batch"),
            [-1 / d, 1 / d],
        )


def test_batch_scope_equals_one_group() -> None:
    rng = np.random.default_rng(0)
    n = 40
    scores = rng.normal(size=n)
    groups = rng.integers(0, 4, size=n)
    episodes = groups * 10 + rng.integers(0, 3, size=n)  # episode ids unique across groups
    agents = rng.choice(["a", "b", "c"], size=n)
    for mode in ("global", "agent", "agent_mean", "agent_std", "step_global"):
        np.testing.assert_allclose(
            compute_advantages(scores, groups, episodes, agents, mode=mode, scope="batch"),
            compute_advantages(scores, np.zeros(n, int), episodes, agents, mode=mode),
            rtol=1e-12,
        )


def test_accepts_numpy_and_empty() -> None:
    out = compute_advantages(np.array(SCORES), np.array(GROUPS), np.array(EPISODES), AGENTS)
    np.testing.assert_allclose(out, _run())
    assert out.dtype == np.float64
    assert compute_advantages([], [], [], []).shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "grpo"}, "unknown advantage mode"),
        ({"std": "sample"}, "unknown std"),
        ({"scope": "episode"}, "unknown scope"),
        ({"eps": -1.0}, "eps"),
    ],
)
def test_rejects_unknown_options(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _run(**kwargs)


def test_rejects_bad_inputs() -> None:
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        compute_advantages([1.0, 2.0, 3.0], [0, 0], [0, 0, 0], ["a", "a", "a"])
    with pytest.raises(ValueError, match="agent_ids has 2 entries"):
        compute_advantages([1.0, 2.0, 3.0], [0, 0, 0], [0, 0, 0], ["a", "a"])
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("nan")], [0, 0], [0, 1], ["a", "a"])
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("inf")], [0, 0], [0, 1], ["a", "a"])
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages([[1.0, 2.0]], [0, 0], [0, 1], ["a", "a"])
    with pytest.raises(ValueError, match="integers"):
        compute_advantages([1.0, 2.0], [0.5, 0.5], [0, 1], ["a", "a"])


# ---------------------------------------------------------------------------------------------
# Property tests
# ---------------------------------------------------------------------------------------------
MODES = ("global", "agent", "agent_mean", "agent_std", "step_global", "agent_turn")
ORDER_FREE = tuple(m for m in MODES if m != "agent_turn")
"""Modes blind to the order of an episode's steps (agent_turn counts an agent's calls)."""


@st.composite
def _groups(draw: st.DrawFn, full: bool) -> tuple[list[float], list[int], list[int], list[str]]:
    """Steps of a few groups. full=True: every group has ≥2 episodes and every episode calls
    agents a and b at least once (and no other agent), so every statistic has ≥2 samples."""
    scores: list[float] = []
    groups: list[int] = []
    episodes: list[int] = []
    agents: list[str] = []
    score = st.integers(-8, 8).map(lambda k: k / 4)
    for g in range(draw(st.integers(1, 3))):
        for e in range(draw(st.integers(2 if full else 1, 4))):
            calls = ["a", "b"] if full else []
            extra = st.sampled_from("ab" if full else "abc")
            calls += draw(st.lists(extra, min_size=0 if full else 1, max_size=3))
            calls = draw(st.permutations(calls))
            for agent in calls:
                scores.append(draw(score))
                groups.append(100 + g)
                episodes.append(e)
                agents.append(agent)
    return scores, groups, episodes, agents


@settings(max_examples=60, deadline=None)
@given(_groups(full=True))
def test_agent_population_gives_zero_mean_unit_std(data: tuple) -> None:
    scores, groups, episodes, agents = data
    assume(_all_sets_vary(data))
    out = compute_advantages(
        scores, groups, episodes, agents, mode="agent", std="population", eps=0.0
    )
    for key in set(zip(groups, agents)):
        idx = [i for i, k in enumerate(zip(groups, agents)) if k == key]
        assert abs(out[idx].mean()) < 1e-9
        assert abs(out[idx].std() - 1.0) < 1e-9  # numpy std is the population std


def _all_sets_vary(data: tuple) -> bool:
    scores, groups, _, agents = data
    values: dict[tuple[int, str], set[float]] = defaultdict(set)
    for s, g, a in zip(scores, groups, agents):
        values[(g, a)].add(s)
    return all(len(v) >= 2 for v in values.values())


@settings(max_examples=60, deadline=None)
@given(_groups(full=True), st.floats(-10, 10), st.sampled_from(MODES), st.booleans())
def test_shift_invariance(data: tuple, shift: float, mode: str, norm: bool) -> None:
    # With ≥2 samples per statistic, adding c to every score moves every mean by c and leaves
    # every std unchanged.
    scores, groups, episodes, agents = data
    base = compute_advantages(scores, groups, episodes, agents, mode=mode, norm_by_std=norm)
    moved = compute_advantages(
        [s + shift for s in scores], groups, episodes, agents, mode=mode, norm_by_std=norm
    )
    np.testing.assert_allclose(moved, base, atol=1e-6)


@settings(max_examples=60, deadline=None)
@given(
    _groups(full=False),
    st.sampled_from(ORDER_FREE),
    st.sampled_from(("unbiased", "population")),
    st.sampled_from(("group", "batch")),
    st.randoms(use_true_random=False),
)
def test_permutation_equivariance(
    data: tuple, mode: str, std: str, scope: str, rnd: object
) -> None:
    scores, groups, episodes, agents = data
    order = list(range(len(scores)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    kw = {"mode": mode, "std": std, "scope": scope}
    base = compute_advantages(scores, groups, episodes, agents, **kw)  # type: ignore[arg-type]
    perm = compute_advantages(
        [scores[i] for i in order],
        [groups[i] for i in order],
        [episodes[i] for i in order],
        [agents[i] for i in order],
        **kw,  # type: ignore[arg-type]
    )
    np.testing.assert_allclose(perm, base[order], rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(_groups(full=False), st.sampled_from(MODES))
def test_relabelling_ids_changes_nothing(data: tuple, mode: str) -> None:
    scores, groups, episodes, agents = data
    base = compute_advantages(scores, groups, episodes, agents, mode=mode)
    renamed = compute_advantages(
        scores,
        [-3 * g for g in groups],
        [e + 1000 for e in episodes],
        [a * 2 for a in agents],
        mode=mode,
    )
    np.testing.assert_allclose(renamed, base, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Independent re-implementation of the reference (verl's compute_grpo_outcome_advantage):
# group scalar scores by an index; per index mean and torch.std (unbiased); an index with a
# single score gets mean 0, std 1; advantage = (score − mean)/(std + eps). Float64 here so
# that "all scores equal" groups are exactly 0 in both (float32 rounding over ε = 1e-6 would
# otherwise be compared, which is no property of the algorithm).
# ---------------------------------------------------------------------------------------------
def _reference_grpo(
    scores: torch.Tensor, index: list[object], eps: float, norm_by_std: bool
) -> torch.Tensor:
    id2score: dict[object, list[torch.Tensor]] = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[index[i]].append(scores[i])
    id2mean: dict[object, torch.Tensor] = {}
    id2std: dict[object, torch.Tensor] = {}
    for key, values in id2score.items():
        if len(values) == 1:
            id2mean[key] = torch.tensor(0.0, dtype=scores.dtype)
            id2std[key] = torch.tensor(1.0, dtype=scores.dtype)
        else:
            stacked = torch.stack(values)
            id2mean[key] = stacked.mean()
            id2std[key] = stacked.std()  # unbiased
    out = scores.clone()
    for i in range(scores.shape[0]):
        if norm_by_std:
            out[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps)
        else:
            out[i] = scores[i] - id2mean[index[i]]
    return out


def _random_batch(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Workflow-like data: team reward 0/1 per episode minus 0.1 for some invalid calls; some
    groups with one episode, some agents called once, uneven calls per episode."""
    rng = np.random.default_rng(seed)
    scores, groups, episodes, agents = [], [], [], []
    for g in rng.permutation(6)[: rng.integers(1, 6)]:
        for e in range(int(rng.integers(1, 6))):
            reward = float(rng.integers(0, 2)) if seed % 2 else float(rng.normal())
            calls = rng.choice(["solver", "verifier", "router"], size=int(rng.integers(1, 6)))
            for agent in calls:
                penalty = 0.1 if rng.random() < 0.2 else 0.0
                scores.append(reward - penalty)
                groups.append(int(g) * 7 + 3)
                episodes.append(int(e))
                agents.append(str(agent))
    return np.array(scores), np.array(groups), np.array(episodes), np.array(agents)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_reference_global(seed: int, norm_by_std: bool) -> None:
    scores, groups, episodes, agents = _random_batch(seed)
    # Reference path: one scalar per episode = mean of its step scores, key = uid (group).
    keys = sorted(set(zip(groups.tolist(), episodes.tolist())))
    episode_score = torch.tensor(
        [scores[(groups == g) & (episodes == e)].mean() for g, e in keys], dtype=torch.float64
    )
    ref = _reference_grpo(episode_score, [g for g, _ in keys], EPS, norm_by_std)
    by_episode = {k: ref[i].item() for i, k in enumerate(keys)}
    expected = [by_episode[(g, e)] for g, e in zip(groups.tolist(), episodes.tolist())]
    out = compute_advantages(
        scores, groups, episodes, agents, mode="global", norm_by_std=norm_by_std
    )
    np.testing.assert_allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_matches_reference_agent(seed: int, norm_by_std: bool) -> None:
    scores, groups, episodes, agents = _random_batch(seed)
    # Reference path with group_by_agent_id: key = (uid, agent id), one score per call.
    index = list(zip(groups.tolist(), agents.tolist()))
    expected = _reference_grpo(torch.tensor(scores), index, EPS, norm_by_std).numpy()
    out = compute_advantages(
        scores, groups, episodes, agents, mode="agent", norm_by_std=norm_by_std
    )
    np.testing.assert_allclose(out, expected, atol=1e-5)
