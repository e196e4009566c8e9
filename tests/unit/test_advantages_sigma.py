"""The small-sample σ options of compute_advantages (algorithm.advantage.agent_std_pool and
std_floor): hand-worked examples, and every mode against a loop-by-loop numpy reference
written here from docs/algorithm.md, not from the broker's code."""

from __future__ import annotations

import math

import numpy as np
import pytest

from drmas.broker.advantages import compute_advantages
from drmas.broker.buffers import ModelBuffer, split_group
from drmas.config.broker import AdvantageConfig
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, Step, Task, pack_group

EPS = 1e-6
MODES = [
    "global",
    "agent",
    "agent_mean",
    "agent_std",
    "step_global",
    "agent_centred",
    "agent_shifted",
]


def reference(
    scores: list[float],
    groups: list[int],
    episodes: list[int],
    agents: list[str],
    *,
    mode: str,
    std: str = "unbiased",
    pool: str = "group",
    floor: float = 0.0,
) -> np.ndarray:
    """docs/algorithm.md by loops. A statistic over one value is mean 0, std 1. Pooled σ_k:
    Σ (s − μ_gk)² over agent k's steps in the groups where it has >= 2 steps, divided by
    Σ (n_gk − ddof) over those groups; its lone steps keep std 1."""
    ddof = 1 if std == "unbiased" else 0
    s = np.asarray(scores, dtype=np.float64)
    n = len(s)

    def stats(values: np.ndarray) -> tuple[float, float]:
        if len(values) <= 1:
            return 0.0, 1.0
        return float(values.mean()), float(values.std(ddof=ddof))

    mu_k, sig_k, mu, sig, mu_all, sig_all, ep_mean = (np.zeros(n) for _ in range(7))
    for g in set(groups):
        in_g = [i for i in range(n) if groups[i] == g]
        m, d = stats(s[in_g])
        mu_all[in_g], sig_all[in_g] = m, d
        eps_of_g = sorted({episodes[i] for i in in_g})
        means = {e: s[[i for i in in_g if episodes[i] == e]].mean() for e in eps_of_g}
        m, d = stats(np.array([means[e] for e in eps_of_g]))
        for i in in_g:
            mu[i], sig[i], ep_mean[i] = m, d, means[episodes[i]]
        for k in {agents[i] for i in in_g}:
            cell = [i for i in in_g if agents[i] == k]
            mu_k[cell], sig_k[cell] = stats(s[cell])
    if pool == "batch":
        for k in set(agents):
            sq, dof, pooled_steps = 0.0, 0, []
            for g in set(groups):
                cell = [i for i in range(n) if groups[i] == g and agents[i] == k]
                if len(cell) >= 2:
                    sq += float(((s[cell] - s[cell].mean()) ** 2).sum())
                    dof += len(cell) - ddof
                    pooled_steps += cell
            sig_k[pooled_steps] = math.sqrt(sq / dof) if dof else 0.0
    value, centre, scale = {
        "global": (ep_mean, mu, sig),
        "agent": (s, mu_k, sig_k),
        "agent_mean": (s, mu_k, sig),
        "agent_std": (s, mu, sig_k),
        "step_global": (s, mu_all, sig_all),
        "agent_centred": (s, mu_k, sig_all),
        "agent_shifted": (s, mu_k, sig_k),
    }[mode]
    out = (value - centre) / (np.maximum(scale, floor) + EPS)
    if mode == "agent_shifted":  # plus step_global's offset
        out += (mu_k - mu_all) / (np.maximum(sig_all, floor) + EPS)
    return out


def _random_batch(seed: int) -> tuple[list[float], list[int], list[int], list[str]]:
    """4 groups of 5 episodes; agent "v" once per episode, "s" 0-2 times (so some groups
    have it lone or absent), "a" once; team rewards 0/1, some steps paying the penalty."""
    rng = np.random.default_rng(seed)
    scores, groups, episodes, agents = [], [], [], []
    for g in range(4):
        for e in range(5):
            team = float(rng.integers(0, 2))
            calls = ["v", *["s"] * int(rng.integers(0, 3)), "a"]
            for agent in calls:
                own = team if rng.random() < 0.5 else float(rng.integers(0, 3)) / 2
                scores.append(own - (0.1 if rng.random() < 0.2 else 0.0))
                groups.append(10 + g)
                episodes.append(e)
                agents.append(agent)
    return scores, groups, episodes, agents


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("std", ["unbiased", "population"])
@pytest.mark.parametrize(("pool", "floor"), [("group", 0.0), ("batch", 0.0), ("group", 0.3),
                                             ("batch", 0.3), ("batch", 2.0)])  # fmt: skip
def test_every_mode_matches_the_reference(seed, mode, std, pool, floor):
    scores, groups, episodes, agents = _random_batch(seed)
    got = compute_advantages(
        scores, groups, episodes, agents, mode=mode, std=std, agent_std_pool=pool, std_floor=floor
    )
    want = reference(scores, groups, episodes, agents, mode=mode, std=std, pool=pool, floor=floor)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-9)


# Hand-worked pooled σ: agent "a" has 2 steps in group 0 and 3 in group 1; "b" is lone in each.
#   group 0: a = 1.0, 0.0  -> μ = 0.5, residuals ±0.5          (Σ r² = 0.5,  n = 2)
#   group 1: a = 0.0, 0.2, 0.4 -> μ = 0.2, residuals −0.2, 0, 0.2 (Σ r² = 0.08, n = 3)
#   unbiased pooled σ_a = sqrt(0.58 / (1 + 2)); population sqrt(0.58 / 5)
#   per-group σ would be sqrt(0.5) = 0.7071 and 0.2: the small group's steps get 3.5x larger
#   advantages than group 0's for the same residual; pooled, both share one scale.
HAND = (
    [1.0, 0.0, 5.0, 0.0, 0.2, 0.4, 7.0],
    [0, 0, 0, 1, 1, 1, 1],
    [0, 1, 1, 0, 1, 2, 2],
    ["a", "a", "b", "a", "a", "a", "b"],
)


@pytest.mark.parametrize(("std", "dof"), [("unbiased", 3), ("population", 5)])
def test_pooled_sigma_by_hand(std, dof):
    sigma = math.sqrt(0.58 / dof)
    out = compute_advantages(*HAND, mode="agent", std=std, agent_std_pool="batch")
    r = [0.5, -0.5, None, -0.2, 0.0, 0.2, None]
    for i, residual in enumerate(r):
        if residual is not None:
            assert out[i] == pytest.approx(residual / (sigma + EPS), rel=1e-12)
    # b's lone steps keep mean 0, std 1: the reference's uncentred score
    assert out[2] == pytest.approx(5.0 / (1 + EPS)) and out[6] == pytest.approx(7.0 / (1 + EPS))


def test_floor_stops_a_penalty_only_difference_from_reaching_unit_size():
    # One group, agent "a" scores 1, 1, 0.9 (the third step paid the 0.1 penalty):
    # μ = 2.9/3, σ (unbiased) = sqrt((2·(0.1/3)² + (0.2/3)²)/2) = 0.1/sqrt(3) = 0.0577.
    # Plain Dr. MAS: (0.9 − μ)/σ = −(0.2/3)/0.0577 = −1.1547; with std_floor 0.5: −0.1333.
    args = ([1.0, 1.0, 0.9], [0, 0, 0], [0, 1, 2], ["a", "a", "a"])
    plain = compute_advantages(*args)
    floored = compute_advantages(*args, std_floor=0.5)
    assert plain[2] == pytest.approx(-(0.2 / 3) / (0.1 / math.sqrt(3) + EPS), rel=1e-9)
    assert plain[2] == pytest.approx(-1.1547, abs=1e-4)
    assert floored[2] == pytest.approx(-(0.2 / 3) / (0.5 + EPS), rel=1e-9)
    # a σ above the floor is untouched: scores 0, 1, 1 have σ = 0.577 > 0.5
    wide = ([0.0, 1.0, 1.0], [0, 0, 0], [0, 1, 2], ["a", "a", "a"])
    np.testing.assert_array_equal(
        compute_advantages(*wide, std_floor=0.5), compute_advantages(*wide)
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("std", ["unbiased", "population"])
def test_defaults_are_bit_identical_and_pooling_one_group_changes_nothing(mode, std):
    scores, groups, episodes, agents = _random_batch(7)
    base = compute_advantages(scores, groups, episodes, agents, mode=mode, std=std)
    same = compute_advantages(
        scores, groups, episodes, agents, mode=mode, std=std, agent_std_pool="group", std_floor=0.0
    )
    np.testing.assert_array_equal(base, same)
    one = [i for i, g in enumerate(groups) if g == groups[0]]  # a single group: pool = group
    sub = ([scores[i] for i in one], [0] * len(one), [episodes[i] for i in one],
           [agents[i] for i in one])  # fmt: skip
    np.testing.assert_array_equal(
        compute_advantages(*sub, mode=mode, std=std, agent_std_pool="batch"),
        compute_advantages(*sub, mode=mode, std=std),
    )
    # scope=batch already treats the input as one group: pooling adds nothing
    np.testing.assert_array_equal(
        compute_advantages(*_random_batch(7), mode=mode, std=std, scope="batch"),
        compute_advantages(
            *_random_batch(7), mode=mode, std=std, scope="batch", agent_std_pool="batch"
        ),
    )


def test_pool_leaves_modes_without_sigma_k_alone():
    scores, groups, episodes, agents = _random_batch(3)
    for mode in ("global", "agent_mean", "step_global"):
        np.testing.assert_array_equal(
            compute_advantages(scores, groups, episodes, agents, mode=mode, agent_std_pool="batch"),
            compute_advantages(scores, groups, episodes, agents, mode=mode),
        )


def test_floor_is_ignored_without_std_normalisation():
    scores, groups, episodes, agents = _random_batch(4)
    np.testing.assert_array_equal(
        compute_advantages(scores, groups, episodes, agents, norm_by_std=False, std_floor=5.0),
        compute_advantages(scores, groups, episodes, agents, norm_by_std=False),
    )


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="agent_std_pool"):
        compute_advantages([1.0], [0], [0], ["a"], agent_std_pool="model")  # type: ignore[arg-type]
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="std_floor must be a finite number >= 0"):
            compute_advantages([1.0], [0], [0], ["a"], std_floor=bad)


def _step(agent: str, valid: bool = True) -> Step:
    ids, lp = pack_ids([3]), pack_logprobs([-0.5])
    return Step(agent, agent, pack_ids([1, 2]), ids, lp, 0, valid, "stop")


def test_the_batch_cut_passes_both_options():
    # Two groups, solver and verifier on their own models; the solver's batch must carry the
    # pooled and floored advantages over the batch's whole groups.
    rewards = [(1.0, 0.0, 0.0), (1.0, 1.0, 0.0)]
    adv = AdvantageConfig(agent_std_pool="batch", std_floor=0.6)
    buf = ModelBuffer("solver", 2, 0, adv)
    scores, groups, episodes, agents = [], [], [], []
    for g, rs in enumerate(rewards):
        eps = [Episode([_step("solver"), _step("verifier", valid=r > 0)], r) for r in rs]
        result = pack_group("actor", g, g, eps)
        task = Task(f"t{g}", "q", "a")
        buf.add(split_group(g, task, result, {"solver": "solver", "verifier": "v"}, 0.1)["solver"])
        for e, r in enumerate(rs):
            scores += [r, r if r > 0 else r - 0.1]
            groups += [g, g]
            episodes += [e, e]
            agents += ["solver", "verifier"]
    batch = buf.batch_for(0, 1)
    assert batch is not None
    want = reference(scores, groups, episodes, agents, mode="agent", pool="batch", floor=0.6)
    got = [s.advantage for s in batch.samples]
    np.testing.assert_allclose(got, want[0::2], rtol=1e-12)
