"""`drmas probe` end to end: the default team's builtin models, real hf engines sampling
groups, and the FSDP2 learner measuring each agent's gradient second moment."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from tests.integration.conftest import drmas

pytestmark = pytest.mark.slow

SMALL = [
    "group_size=4",
    "models.solver.warmstart.steps=60",
    "models.verifier.warmstart.steps=60",
    "probe.group_size=4",
]


def test_synthetic_probe_shows_inflation_and_deflation(tmp_path: Path, model_cache: Path):
    # Solver scores N(0, 3), Verifier N(1, 0.3): pooled over all steps (step_global) the
    # team's σ² is about half the Solver's σ_k², so its gradient is inflated (F ≈ 1.7) and
    # the Verifier's deflated (F ≈ 0.16); agent-wise normalisation makes both 1. The
    # measured ratio (per-step second moments on the learner) follows the factor.
    run = tmp_path / "syn"
    out = drmas(
        "probe", *SMALL, f"run.dir={run}", f"run.cache_dir={model_cache}",
        "probe.rewards={solver: [0, 3], verifier: [1, 0.3]}", "probe.groups=24",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run / "probe.json").read_text())
    assert result["mode"] == "synthetic" and result["groups"] == 24
    agents = result["agents"]
    assert set(agents) == {"solver", "verifier"}
    for by_base in agents.values():
        assert set(by_base) == {"global", "step_global"}
        for r in by_base.values():
            for key, ci in [
                ("measured_ratio", "ci95"),
                ("predicted_factor", "predicted_ci95"),
                ("agreement", "agreement_ci95"),
                ("batch_ratio", "batch_ci95"),
            ]:
                lo, hi = r[ci]
                assert lo <= r[key] <= hi, (key, r)
            assert r["n_groups"] == 24 and 0 < r["effective_steps"] <= r["n_steps"]
    solver, verifier = agents["solver"]["step_global"], agents["verifier"]["step_global"]
    assert solver["predicted_factor"] > 1.3 and solver["measured_ratio"] > 1.1
    assert verifier["predicted_factor"] < 0.4 and verifier["measured_ratio"] < 0.6
    # credit: under agent and step_global an agent's advantage is affine in its own scores
    # within a group (a rescaling only); global mixes in the other agent's scores
    credit = result["credit"]
    for agent in ("solver", "verifier"):
        assert credit[agent]["agent"]["own_r2"] == pytest.approx(1.0)
        assert credit[agent]["step_global"]["own_r2"] == pytest.approx(1.0)
        assert credit[agent]["global"]["own_r2"] < 0.9 and credit[agent]["agent"]["groups"] == 24
    assert "own r^2: are an agent's advantages one affine function of its own scores?" in out.stdout
    image = mpimg.imread(run / "probe.png")
    assert image.shape[0] > 100 and image.shape[1] > 300
    assert "step_global" in out.stdout  # the table is printed


def test_sampled_probe_scores_role_rewards(tmp_path: Path, model_cache: Path):
    # Sampled (no probe.rewards): real hf engines play the team and the probe scores what
    # they did. workflow.rewards=role: every step of the math team carries its own
    # Step.reward (0/1), and the probe scores the steps with those, as the broker does.
    # (Under team rewards the steps carry none and the episode's reward scores them: the
    # probe's scoring of that case is tests/unit/test_probe_scores.py's, the team's
    # tests/unit/test_role_rewards.py's.)
    run = tmp_path / "role"
    out = drmas(
        "probe", *SMALL, f"run.dir={run}", f"run.cache_dir={model_cache}", "probe.groups=4",
        "workflow.rewards=role",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((run / "probe.json").read_text())
    assert result["mode"] == "sampled" and result["rewards"] == {}
    for by_base in result["agents"].values():
        assert set(by_base) == {"global", "step_global"}
    steps = sum(s["steps"] for s in result["scores"].values())
    assert result["own_reward_steps"] == steps >= 4 * 4
    # real scores are role rewards (0/1) minus the 0.1 penalty of an unparseable action
    for agent, s in result["scores"].items():
        assert -0.1 <= s["mean"] <= 1.0, agent


def test_probe_refuses_rewards_for_part_of_the_team(tmp_path: Path):
    out = drmas("probe", f"run.dir={tmp_path}", "probe.rewards={solver: [0, 1]}", timeout=60)
    assert out.returncode == 2
    assert "probe.rewards must give [mean, std] for every agent" in out.stderr
