"""`drmas train` with skip_zero_variance on a team whose groups tie: tied groups are
skipped, counted, and the batches still fill. (The small-sample options on the default
team, agent_std_pool=batch, std_floor and skip_zero_variance, are checked in
test_train.py's test_train_non_shared run, to pay for one run instead of two.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

AGENTS = ("solver", "verifier")


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
