"""drmas probe against Lemma 4.2 on a model whose answer is known: a log-linear (softmax)
policy over three actions, two agents with synthetic scores, the broker's advantages, the
learner's policy loss (drmas/learners/probe.py: weighted_loss) and the probe's statistics
(group_moments, summarise).

The policy. Agent k has its own logits θ_k; one step is one action a ~ π_k = softmax(θ_k)
(or, in the normaliser test, a few independent actions). At ratio 1 the step's policy
loss has gradient −A·h with h = ∇_θ log π(a) = e_a − π, so ‖h‖² = 1 − 2π_a + ‖π‖²
(action-dependent unless π is uniform) and E[h] = 0, E‖h‖² = 1 − ‖π‖².

The scores. Each group has G = 4 episodes; agent "one" acts once per episode (4 steps),
agent "two" twice (8 steps). Agent one's scores are 3 ± 1 (two steps at 2, two at 4),
agent two's 0 ± σ₂ (four at −σ₂, four at +σ₂), in an order drawn independently of the
actions, so every group has exactly these statistics (population std):

    team mean  μ  = (4·3 + 8·0) / 12 = 1
    team var   σ² = [4·(1² + (3 − 1)²) + 8·(σ₂² + (0 − 1)²)] / 12 = (7 + 2σ₂²) / 3
    F_one = (σ_one² + (μ_one − μ)²) / σ² = (1 + 4) / σ² = 15 / (7 + 2σ₂²)
    F_two = (σ₂² + (0 − 1)²) / σ²      = 3(σ₂² + 1) / (7 + 2σ₂²)

    σ₂² = 0.25 -> F_one = 15/7.5 = 2,   F_two = 3.75/7.5 = 0.5
    σ₂² = 4    -> F_one = 15/15  = 1,   F_two = 15/15    = 1
    σ₂² = 11.5 -> F_one = 15/30  = 0.5, F_two = 37.5/30  = 1.25
    σ₂² = 34   -> F_one = 15/75  = 0.2, F_two = 105/75   = 1.4

(the step-weighted mean of the two is 1: (4 F_one + 8 F_two)/12 = 1, a check). Agent one is
the narrow agent whose mean sits far above the team's (3 against 1) once σ₂ is large.
With ε = 0, step_global's A = (s − μ)/σ and agent's A = (s − μ_k)/σ_k, so over agent k's
n_k steps of a group Σ A_agent² = n_k and Σ A_step_global² = n_k F_k: the probe's
predicted factor is F_k exactly. The measured ratio weights each step's A² by its ‖h_i‖²
and the batch ratio is the real gradient's ‖Σ A_i h_i‖²; both have expectation ratio F_k
(the h_i are independent of the scores and of each other, mean 0). With 400 groups their
intervals are tight enough (checked: max/min < 1.6) to tell a factor from its neighbours.

A confident policy, π = (0.98, 0.01, 0.01), shows why the probe reports effective steps:
‖h‖² is 1 − 2·0.98 + ‖π‖² = 0.0006 for the usual action and 1 − 0.02 + 0.9606 = 1.9406 for
either rare one (‖π‖² = 0.9604 + 0.0001 + 0.0001 = 0.9606), so
E‖h‖² = 0.98·0.0006 + 0.02·1.9406 = 0.0394 (= 1 − ‖π‖²) and
E‖h‖⁴ = 0.98·0.0006² + 0.02·1.9406² = 0.07532: the effective share of steps
(Σ‖h‖²)²/(n Σ‖h‖⁴) → 0.0394²/0.07532 = 0.0206. The 2 % of steps that drew a rare action
carry the measurement; it still estimates F, with an interval as wide as that makes it.

Tests are deterministic (fixed seeds). The intervals checked are the probe's percentile
bootstrap at 99.9 % coverage (summarise's `level`): the 24 interval checks would fail by
chance for about 2 of 3 seeds at 95 %, and for about 1 in 40 at 99.9 % (at most; the
checks are correlated).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from drmas.broker.advantages import compute_advantages
from drmas.config.learner import LossConfig
from drmas.learners.probe import AgentRows, group_moments, summarise, weighted_loss

PI = {"one": np.array([0.5, 0.3, 0.2]), "two": np.array([0.7, 0.2, 0.1])}
GROUPS = 400
EPISODES = 4
LEVEL = 0.999


class LogLinear:
    """`Gradients` of one agent's steps under a softmax policy over len(pi) actions; a step
    is a sequence of actions (its response tokens)."""

    def __init__(self, pi: np.ndarray, actions: Sequence[Sequence[int]]) -> None:
        self.theta = torch.tensor(np.log(pi), dtype=torch.float64, requires_grad=True)
        self.actions = [list(a) for a in actions]

    @property
    def steps(self) -> int:
        return len(self.actions)

    def sq_norm(self, rows: Sequence[int], weights: np.ndarray) -> float:
        width = max(len(self.actions[i]) for i in rows)
        index = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width))
        for r, i in enumerate(rows):
            index[r, : len(self.actions[i])] = torch.tensor(self.actions[i])
            mask[r, : len(self.actions[i])] = 1.0
        self.theta.grad = None
        logprobs = torch.log_softmax(self.theta, 0)[index]  # [B, L]
        loss = weighted_loss(logprobs, logprobs.detach(), mask, weights, LossConfig())
        loss.backward()
        assert self.theta.grad is not None
        return float(self.theta.grad.square().sum())


def probe_two_agents(
    var_two: float, seed: int, pi: dict[str, np.ndarray] = PI
) -> dict[str, dict[str, dict[str, object]]]:
    """GROUPS synthetic groups as in the module docstring, measured like `drmas probe`."""
    rng = np.random.default_rng(seed)
    rows = {"one": AgentRows(), "two": AgentRows()}
    patterns = {
        "one": 3.0 + np.array([-1.0, -1, 1, 1]),
        "two": np.sqrt(var_two) * np.repeat([-1.0, 1], 4),
    }
    agents = ["one"] * EPISODES + ["two"] * (2 * EPISODES)
    episodes = list(range(EPISODES)) + [e for e in range(EPISODES) for _ in range(2)]
    for _ in range(GROUPS):
        scores = np.concatenate(
            [rng.permutation(patterns["one"]), rng.permutation(patterns["two"])]
        )
        adv = {
            mode: compute_advantages(
                scores,
                np.zeros(len(scores), dtype=np.int64),
                episodes,
                agents,
                mode=mode,
                eps=0.0,
                std="population",
            )
            for mode in ("agent", "step_global")
        }
        for agent in ("one", "two"):
            idx = [i for i, a in enumerate(agents) if a == agent]
            actions = [[int(rng.choice(3, p=pi[agent]))] for _ in idx]
            moments = group_moments(
                LogLinear(pi[agent], actions), {m: a[idx] for m, a in adv.items()}
            )
            rows[agent].add(moments, len(idx))
    return summarise(rows, ["step_global"], bootstrap=2000, seed=seed, level=LEVEL)


def _check(r: dict[str, object], factor: float, steps: int) -> None:
    assert r["predicted_factor"] == pytest.approx(factor, rel=1e-12), r
    assert r["n_groups"] == GROUPS and r["n_steps"] == steps
    for key, ci in (("measured_ratio", "ci95"), ("batch_ratio", "batch_ci95")):
        lo, hi = r[ci]
        assert lo <= factor <= hi, (key, r)
        assert lo <= r[key] <= hi
    lo, hi = r["agreement_ci95"]
    assert lo <= 1.0 <= hi, r


@pytest.mark.parametrize(
    ("var_two", "f_one", "f_two"),
    [(0.25, 2.0, 0.5), (4.0, 1.0, 1.0), (11.5, 0.5, 1.25), (34.0, 0.2, 1.4)],
)
def test_prediction_and_measurement_agree_with_the_lemma(var_two, f_one, f_two):
    out = probe_two_agents(var_two, seed=0)
    for agent, factor, steps in (("one", f_one, 4 * GROUPS), ("two", f_two, 8 * GROUPS)):
        r = out[agent]["step_global"]
        _check(r, factor, steps)
        for ci in ("ci95", "batch_ci95"):
            lo, hi = r[ci]
            assert hi / lo < 1.6, (agent, ci, r)  # informative, not just wide


def test_a_confident_policy_rests_on_its_rare_actions():
    # σ₂² = 34: F_one = 0.2, F_two = 1.4 (module docstring), agent one confident.
    out = probe_two_agents(34.0, seed=0, pi={"one": np.array([0.98, 0.01, 0.01]), "two": PI["two"]})
    one = out["one"]["step_global"]
    _check(one, 0.2, 4 * GROUPS)
    # effective share of steps -> 0.0206; rare draws ~ Binomial(1600, 0.02): 32 ± 5.6
    assert 0.01 < one["effective_steps"] / one["n_steps"] < 0.035, one
    _check(out["two"]["step_global"], 1.4, 8 * GROUPS)


def test_a_steps_gradient_is_its_token_sum_whatever_the_group():
    # Steps of 1, 2 and 5 actions under π = (0.5, 0.3, 0.2): h = Σ_t (e_{a_t} − π), with no
    # division by the step's or the group's token count (the batch's common normaliser).
    pi = np.array([0.5, 0.3, 0.2])
    actions = [[0], [1, 2], [2, 2, 0, 1, 2]]
    grads = LogLinear(pi, actions)
    h = [np.sum([np.eye(3)[a] - pi for a in step], axis=0) for step in actions]
    for i in range(3):
        assert grads.sq_norm([i], np.ones(1)) == pytest.approx(float(h[i] @ h[i]), rel=1e-6)
    # By hand for step 0: e_0 − π = (0.5, −0.3, −0.2), ‖·‖² = 0.25 + 0.09 + 0.04 = 0.38.
    assert grads.sq_norm([0], np.ones(1)) == pytest.approx(0.38, rel=1e-6)
    w = np.array([1.5, -0.5, 2.0])
    g = sum(wi * hi for wi, hi in zip(w, h))
    assert grads.sq_norm([0, 1, 2], w) == pytest.approx(float(g @ g), rel=1e-6)
    moments = group_moments(grads, {"agent": w, "step_global": 2 * w})
    diag = float(np.square(w) @ np.array([hi @ hi for hi in h]))
    assert moments.diag["agent"] == pytest.approx(diag, rel=1e-6)
    assert moments.full["step_global"] == pytest.approx(4 * float(g @ g), rel=1e-6)
    assert moments.adv_sq["agent"] == pytest.approx(1.5**2 + 0.5**2 + 2.0**2)
    assert moments.step_sq == pytest.approx([float(hi @ hi) for hi in h], rel=1e-6)
