"""drmas probe's statistics (drmas/learners/probe.py: summarise), on hand-made rows."""

from __future__ import annotations

import numpy as np
import pytest

from drmas.learners.probe import AgentRows, summarise


def test_ratio_of_means_prediction_and_interval():
    rows = AgentRows()
    # Three groups. ‖g‖² under agent: 1, 2, 3 (mean 2); under step_global: 2, 6, 4 (mean 4).
    # Σ A² over the agent's steps: agent 1 + 1 + 2 = 4; step_global 3 + 4 + 5 = 12.
    for g_agent, g_base, a_agent, a_base in [
        (1, 2, [1.0], [3**0.5]),
        (2, 6, [1.0], [2.0]),
        (3, 4, [2**0.5], [5**0.5]),
    ]:
        rows.add(
            {"agent": g_agent, "step_global": g_base},
            {"agent": np.array(a_agent), "step_global": np.array(a_base)},
        )
    out = summarise({"solver": rows}, ["step_global"], bootstrap=500, seed=0)["solver"][
        "step_global"
    ]
    assert out["measured_ratio"] == pytest.approx(4 / 2)
    assert out["predicted_factor"] == pytest.approx(12 / 4)
    assert out["n_groups"] == 3
    lo, hi = out["ci95"]
    # A resample's ratio of paired means lies between the smallest and the largest per-group
    # ratio base/agent: 2/1, 6/2, 4/3 -> [4/3, 3].
    assert 4 / 3 - 1e-9 <= lo <= out["measured_ratio"] <= hi <= 3 + 1e-9


def test_agent_with_zero_agent_gradient_gives_nan_not_a_crash():
    rows = AgentRows()
    rows.add({"agent": 0.0, "global": 1.0}, {"agent": np.zeros(2), "global": np.ones(2)})
    rows.add({"agent": 0.0, "global": 2.0}, {"agent": np.zeros(2), "global": np.ones(2)})
    out = summarise({"v": rows}, ["global"], bootstrap=10, seed=0)["v"]["global"]
    assert np.isnan(out["measured_ratio"]) and np.isnan(out["predicted_factor"])
