"""drmas probe's statistics (drmas/learners/probe.py: summarise), on hand-made rows."""

from __future__ import annotations

import numpy as np
import pytest

from drmas.learners.probe import AgentRows, GroupMoments, summarise


def _moments(full, diag, adv_sq) -> GroupMoments:
    modes = ("agent", "step_global")
    return GroupMoments(dict(zip(modes, full)), dict(zip(modes, diag)), dict(zip(modes, adv_sq)))


def test_ratios_of_sums_over_groups_and_their_intervals():
    rows = AgentRows()
    # Three groups: (agent, step_global) values of ‖Σ A h‖², Σ A² ‖h‖², Σ A², and steps.
    rows.add(_moments((1, 2), (1, 3), (1, 3)), 2)
    rows.add(_moments((2, 6), (2, 4), (1, 4)), 3)
    rows.add(_moments((3, 4), (1, 1), (2, 5)), 4)
    out = summarise({"solver": rows}, ["step_global"], bootstrap=500, seed=0)["solver"][
        "step_global"
    ]
    # predicted = Σ A² ratio (3 + 4 + 5)/(1 + 1 + 2) = 3; measured = Σ A² ‖h‖² ratio
    # (3 + 4 + 1)/(1 + 2 + 1) = 2; batch = ‖Σ A h‖² ratio (2 + 6 + 4)/(1 + 2 + 3) = 2.
    assert out["predicted_factor"] == pytest.approx(12 / 4)
    assert out["measured_ratio"] == pytest.approx(8 / 4)
    assert out["batch_ratio"] == pytest.approx(12 / 6)
    assert out["agreement"] == pytest.approx(2 / 3)
    assert out["n_groups"] == 3 and out["n_steps"] == 9
    # A resample's ratio of sums lies between the smallest and the largest per-group ratio:
    # predicted 3/1, 4/1, 5/2 -> [2.5, 4]; measured 3/1, 4/2, 1/1 -> [1, 3]; batch 2/1, 6/2,
    # 4/3 -> [4/3, 3]; their agreement between 1/4 and 3/2.5.
    for key, ci, low, high in [
        ("predicted_factor", "predicted_ci95", 2.5, 4),
        ("measured_ratio", "ci95", 1, 3),
        ("batch_ratio", "batch_ci95", 4 / 3, 3),
        ("agreement", "agreement_ci95", 1 / 4, 1.2),
    ]:
        lo, hi = out[ci]
        assert low - 1e-9 <= lo <= out[key] <= hi <= high + 1e-9, key


def test_a_wider_level_gives_a_wider_interval():
    rows = AgentRows()
    rng = np.random.default_rng(1)
    for _ in range(30):
        a, b = rng.uniform(0.5, 2.0, size=2)
        rows.add(_moments((a, b), (a, b), (1, 1)), 2)
    narrow = summarise({"v": rows}, ["step_global"], bootstrap=2000, seed=0, level=0.5)
    wide = summarise({"v": rows}, ["step_global"], bootstrap=2000, seed=0, level=0.99)
    (nlo, nhi), (wlo, whi) = narrow["v"]["step_global"]["ci95"], wide["v"]["step_global"]["ci95"]
    assert wlo < nlo < nhi < whi
    with pytest.raises(ValueError, match="level"):
        summarise({"v": rows}, ["step_global"], bootstrap=10, seed=0, level=1.0)


def test_agent_with_zero_agent_gradient_gives_nan_not_a_crash():
    rows = AgentRows()
    for _ in range(2):
        rows.add(
            GroupMoments(
                {"agent": 0.0, "global": 1.0},
                {"agent": 0.0, "global": 1.0},
                {"agent": 0.0, "global": 2.0},
            ),
            2,
        )
    out = summarise({"v": rows}, ["global"], bootstrap=10, seed=0)["v"]["global"]
    assert np.isnan(out["measured_ratio"]) and np.isnan(out["predicted_factor"])
    assert np.isnan(out["batch_ratio"]) and np.isnan(out["agreement"])


def test_effective_steps_count_how_many_steps_carry_the_gradient_weight():
    rows = AgentRows()
    # ‖h_i‖² of the steps: group 1 has 1 and 1, group 2 has 2: (1 + 1 + 2)² / (1 + 1 + 4).
    rows.add(
        GroupMoments(
            {"agent": 1.0, "global": 1.0},
            {"agent": 1.0, "global": 1.0},
            {"agent": 1.0, "global": 1.0},
            [1.0, 1.0],
        ),
        2,
    )
    rows.add(
        GroupMoments(
            {"agent": 1.0, "global": 1.0},
            {"agent": 1.0, "global": 1.0},
            {"agent": 1.0, "global": 1.0},
            [2.0],
        ),
        1,
    )
    out = summarise({"v": rows}, ["global"], bootstrap=10, seed=0)["v"]["global"]
    assert out["effective_steps"] == pytest.approx(16 / 6)
