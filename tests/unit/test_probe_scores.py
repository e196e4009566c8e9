"""drmas/launch/probe.py without a model: each step is scored as the broker does
(step_scores: its own Step.reward where the team set one, else the episode's team reward,
minus the invalid-action penalty; synthetic mode ignores both), advantages as the batch
cut computes them (probe_advantages, the run's algorithm.advantage), and the table and
plot show what summarise returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from drmas.config.load import load_config
from drmas.launch.probe import format_table, plot, probe_advantages, step_scores
from drmas.learners.probe import AgentRows, GroupMoments, summarise
from drmas.protocol.arrays import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, Step


def _step(agent: str, valid: bool, reward: float | None) -> Step:
    return Step(
        agent, "m", pack_ids([1]), pack_ids([2]), pack_logprobs([-0.5]), 0, valid, "stop", reward
    )


EPISODES = [
    # team reward 0; the verifier is paid 1 for its own verdict but did not parse one
    Episode([_step("solver", True, None), _step("verifier", False, 1.0)], reward=0.0),
    # team reward 1; the solver is paid 0.5 for its own answer
    Episode([_step("solver", True, 0.5), _step("verifier", True, None)], reward=1.0),
]


def test_sampled_scores_use_each_steps_own_reward():
    cfg = load_config(["algorithm.invalid_action_penalty=0.25"])
    scores = step_scores(cfg, EPISODES, np.random.default_rng(0))
    # 0 (team), 1 − 0.25 (own, invalid), 0.5 (own), 1 (team)
    assert scores.tolist() == [0.0, 0.75, 0.5, 1.0]


def test_team_rewards_alone_give_todays_scores():
    cfg = load_config(["algorithm.invalid_action_penalty=0.25"])
    team = [
        Episode([_step("solver", True, None), _step("verifier", False, None)], reward=1.0),
        Episode([_step("solver", False, None)], reward=0.0),
    ]
    assert step_scores(cfg, team, np.random.default_rng(0)).tolist() == [1.0, 0.75, -0.25]


def test_synthetic_scores_ignore_rewards_and_validity():
    cfg = load_config(["probe.rewards={solver: [0, 1], verifier: [5, 0]}"])
    scores = step_scores(cfg, EPISODES, np.random.default_rng(3))
    # One normal draw per step in episode order: loc + scale · z with z standard normal.
    z = np.random.default_rng(3).standard_normal(4)
    assert scores.tolist() == pytest.approx([z[0], 5.0, z[2], 5.0])


def test_table_and_plot_show_every_agent_and_baseline(tmp_path: Path):
    rows = {a: AgentRows() for a in ("solver", "verifier")}
    for g in range(4):
        for r in rows.values():
            moments = {"agent": 1.0 + g, "global": 2.0 + g, "step_global": 0.5 + g}
            r.add(GroupMoments(moments, moments, moments, [1.0, 2.0]), 2)
    result = {
        "mode": "synthetic",
        "groups": 4,
        "group_size": 2,
        "agents": summarise(rows, ["global", "step_global"], bootstrap=50, seed=0),
    }
    table = format_table(result)
    lines = table.splitlines()
    assert len(lines) == 2 + 4 and "measured/predicted" in lines[1]
    # solver/global: predicted = measured = batch = (2+3+4+5)/(1+2+3+4) = 1.4; effective
    # steps (4·(1 + 2))² / (4·(1 + 4)) = 7.2 of 8
    assert lines[2].split()[:4] == ["solver", "global", "1.400", "1.400"]
    assert lines[2].endswith(" 7/8")
    plot(result, tmp_path / "probe.png")
    assert (tmp_path / "probe.png").stat().st_size > 1000


def test_advantages_follow_the_runs_options_group_by_group():
    cfg = load_config(["algorithm.advantage.std_floor=0.5"])
    groups = [
        [Episode([_step("solver", True, None), _step("verifier", True, None)], reward=0.0)] * 2,
        [Episode([_step("solver", True, None)], reward=0.0)] * 2,
    ]
    scores = [np.array([1.0, 0.5, 0.8, 0.5]), np.array([0.0, 2.0])]
    out = probe_advantages(cfg, groups, scores)
    assert [sorted(g) for g in out] == [["agent", "global", "step_global"]] * 2
    d = 1 + 2e-6  # (σ + ε) with σ = 0.5 (the floor), ε = 1e-6, divided out below
    # group 0, agent: solver 1, 0.8 -> μ 0.9, σ 0.141 < floor -> ±0.1/0.5; verifier σ 0 -> 0
    assert out[0]["agent"] * d == pytest.approx([0.2, 0.0, -0.2, 0.0])
    # group 0, step_global: μ 0.7, σ = sqrt(0.18/3) = 0.245 < floor -> (s − 0.7)/0.5
    assert out[0]["step_global"] * d == pytest.approx([0.6, -0.4, 0.2, -0.4])
    # group 1 on its own: solver 0, 2 -> μ 1, σ sqrt(2) above the floor -> ∓1/sqrt(2)
    assert out[1]["agent"] == pytest.approx([-(0.5**0.5), 0.5**0.5], rel=1e-5)


def test_credit_shares_tell_a_rescaling_from_a_credit_problem() -> None:
    """Solver then Verifier once per episode, solver scores (1, 0, 0, 1), verifier (0, 0, 1,
    1). Under agent and step_global a step's advantage is affine in its own score in the
    group: r² = 1. Under global every step gets its episode's mean (0.5, 0, 0.5, 1); centred,
    solver (.5, -.5, -.5, .5) against (0, -.5, 0, .5): cov 0.125, var 0.25 and 0.125, so
    r² = 0.125² / (0.25 · 0.125) = 0.5, and the same for the verifier."""
    from drmas.broker.advantages import compute_advantages
    from drmas.launch.probe import credit_shares

    agents = ["solver", "verifier"] * 4
    scores = np.array([1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    episodes = [0, 0, 1, 1, 2, 2, 3, 3]
    adv = {
        m: compute_advantages(scores, [0] * 8, episodes, agents, mode=m)
        for m in ("agent", "step_global", "global")
    }
    credit = credit_shares([agents], [scores], [adv])
    for agent in ("solver", "verifier"):
        assert credit[agent]["agent"] == {"own_r2": pytest.approx(1.0), "groups": 1}
        assert credit[agent]["step_global"]["own_r2"] == pytest.approx(1.0)
        assert credit[agent]["global"]["own_r2"] == pytest.approx(0.5)
    # an agent whose scores do not vary in a group: nothing to explain, not counted
    flat = credit_shares([agents], [np.array([1.0, 0.0] * 4)], [adv])
    assert "solver" not in flat and "verifier" not in flat


def test_agent_turn_is_a_mode_the_probe_compares() -> None:
    """probe.baselines takes agent_turn: a Solver called twice per episode is normalised per
    call (turn 0 with turn 0, turn 1 with turn 1), unlike `agent`, which pools its calls."""
    cfg = load_config(["probe.baselines=[agent_turn]"])
    solver_twice = [
        Episode([_step("solver", True, None), _step("solver", True, None)], reward=0.0)
    ] * 2
    scores = [np.array([1.0, 10.0, 3.0, 20.0])]  # turn 0: 1, 3; turn 1: 10, 20
    (out,) = probe_advantages(cfg, [solver_twice], scores)
    assert sorted(out) == ["agent", "agent_turn"]
    # agent_turn: turn 0 μ 2, σ √2 -> ∓1/√2; turn 1 μ 15, σ √50 -> ∓5/√50 = ∓1/√2
    assert out["agent_turn"] == pytest.approx(
        [-(0.5**0.5), -(0.5**0.5), 0.5**0.5, 0.5**0.5], rel=1e-5
    )
    # agent: one pool of 1, 10, 3, 20 (μ 8.5): the turn-1 calls get the larger advantages
    assert abs(out["agent"][3]) > abs(out["agent"][2])


def test_advantage_offsets_split_a_shared_baselines_offset_from_its_scale() -> None:
    """Solver scores (1, 0, 1, 0), Verifier paid a tenth (0.1, 0, 0.1, 0), one group. Under
    `agent` each agent's advantages are ±√3/2: mean 0, no offset. Under step_global one
    baseline μ = 0.275 and σ (unbiased, all 8 steps) serve both: the Solver sits at
    (0.5 − 0.275)/σ with sd 0.5/σ, the Verifier at (0.05 − 0.275)/σ with sd 0.05/σ, so
    nearly all of the Verifier's second moment is offset."""
    from drmas.broker.advantages import compute_advantages
    from drmas.launch.probe import advantage_offsets

    agents = ["solver", "verifier"] * 4
    scores = np.array([1.0, 0.1, 0.0, 0.0, 1.0, 0.1, 0.0, 0.0])
    adv = {
        m: compute_advantages(scores, [0] * 8, [0, 0, 1, 1, 2, 2, 3, 3], agents, mode=m)
        for m in ("agent", "step_global")
    }
    out = advantage_offsets([agents], [adv])
    for agent in ("solver", "verifier"):
        assert out[agent]["agent"]["mean"] == pytest.approx(0.0, abs=1e-6)
        assert out[agent]["agent"]["sd"] == pytest.approx(3**0.5 / 2, rel=1e-4)
        assert out[agent]["agent"]["offset_share"] == pytest.approx(0.0, abs=1e-6)
    sigma = float(np.std(scores, ddof=1))
    for agent, own_mean, own_sd in (("solver", 0.5, 0.5), ("verifier", 0.05, 0.05)):
        r = out[agent]["step_global"]
        assert r["mean"] == pytest.approx((own_mean - 0.275) / sigma, rel=1e-4)
        assert r["sd"] == pytest.approx(own_sd / sigma, rel=1e-4)
        assert r["sq"] == pytest.approx(r["mean"] ** 2 + r["sd"] ** 2)
        assert r["steps"] == 4
    assert out["verifier"]["step_global"]["offset_share"] == pytest.approx(
        0.225**2 / (0.225**2 + 0.05**2), rel=1e-4
    )
    assert out["solver"]["step_global"]["offset_share"] == pytest.approx(
        0.225**2 / (0.225**2 + 0.5**2), rel=1e-4
    )
