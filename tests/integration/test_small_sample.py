"""`drmas train` with the small-sample options on (agent_std_pool=batch, std_floor,
skip_zero_variance): the run finishes with exact accounting, and its metrics lines carry
the per-agent diagnostics and the zero-variance count (issue #24)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import FAST, drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

AGENTS = ("solver", "verifier")


def test_train_with_pooled_floored_sigma_and_zero_variance_groups_skipped(
    tmp_path: Path, model_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    out = drmas(
        "train",
        *FAST,
        "algorithm.advantage.agent_std_pool=batch",
        "algorithm.advantage.std_floor=0.3",
        "algorithm.skip_zero_variance=true",
        f"run.dir={run_dir}",
        f"run.cache_dir={model_cache}",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2, 3, 4]
    skipped = [x["zero_variance_groups_skipped"] for x in train]
    assert skipped == sorted(skipped)  # a running count
    for line in train:
        for agent in AGENTS:
            acting = line[f"groups_acting/{agent}"]
            assert acting == 4  # both agents act in every episode: in all 4 groups
            assert 0 <= line[f"groups_penalty_only/{agent}"] <= line[f"groups_varying/{agent}"]
            assert line[f"groups_lone/{agent}"] == 0
            assert line[f"advantage/{agent}/max_abs"] >= 0
    summary = read_summary(run_dir)
    c = summary["counters"]
    if not c.get("dropped_stale_groups", 0):
        # Both models then cut the same 4 groups (each has a slice of every group, taken in
        # the same order), and a skipped group never reaches a batch: in each of them some
        # agent's scores vary.
        for line in train:
            assert sum(line[f"groups_varying/{a}"] for a in AGENTS) >= 4
    assert c.get("groups_trained_twice", 0) == 0 and summary["leases"]["balanced"] == 1
    assert c.get("zero_variance_groups_skipped", 0) >= skipped[-1]
    for model in AGENTS:
        trained = summary["trained_groups"][model]
        assert trained == 4 * 4  # train.steps × batch_groups, topped up past skipped groups
        assert trained + c.get("zero_variance_groups_skipped", 0) <= summary["accepted_groups"]


def test_tied_groups_are_skipped_and_batches_topped_up(tmp_path: Path, model_cache: Path) -> None:
    """TieTeam (tests/fixtures/tie_team.py) ties every group of half of the tasks: those are
    skipped, counted, and the batches still fill with train.steps × batch_groups groups."""
    run_dir = tmp_path / "run"
    out = drmas(
        "train", "workflow.target=tests.fixtures.tie_team:TieTeam", "train.steps=3",
        "group_size=4", "batch_groups=2", "val.every=0", "algorithm.skip_zero_variance=true",
        "models.solver.warmstart.steps=60", "models.verifier.warmstart.steps=60",
        "broker.heartbeat_timeout_s=10", "weights.timeout_s=10",
        f"run.dir={run_dir}", f"run.cache_dir={model_cache}",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = read_summary(run_dir)
    c = summary["counters"]
    skipped = c.get("zero_variance_groups_skipped", 0)
    assert skipped >= 1 and c.get("groups_trained_twice", 0) == 0
    for model in AGENTS:
        assert summary["trained_groups"][model] == 3 * 2
        assert summary["trained_groups"][model] + skipped <= summary["accepted_groups"]
    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2, 3]
    for line in train:  # every trained group varies: team rewards differ, both agents see it
        assert line["groups_varying/solver"] == line["groups_varying/verifier"] == 2
        assert line["groups_penalty_only/solver"] == 0
