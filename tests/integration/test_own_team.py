"""The example team of examples/proposer_critic, trained from outside the package: a copy
of its folder in a temporary directory, run from there with `--config`, exactly as a user
with their own team in their own repository would."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import REPO, read_metrics

pytestmark = pytest.mark.slow


def test_example_team_trains_from_its_own_folder(tmp_path: Path, model_cache: Path) -> None:
    team = tmp_path / "my_team"
    shutil.copytree(REPO / "examples" / "proposer_critic", team)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", "train", "--config", "my_team/config.yaml",
         "train.steps=2", "group_size=4", "batch_groups=2", "val.every=2", "val.num_tasks=8",
         "models.proposer.warmstart.steps=60", "models.critic.warmstart.steps=60",
         f"run.dir={run_dir}", f"run.cache_dir={model_cache}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["workflow"]["name"] == "proposer_critic"
    assert saved["workflow"]["target"] == f"{team / 'team.py'}:ProposerCritic"  # absolute
    assert saved["task"]["name"] == f"{team / 'team.py'}:tasks"
    lines = read_metrics(run_dir)
    train = [x for x in lines if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2]
    for line in train:
        for agent, model in (("proposer", "proposer"), ("critic", "critic")):
            assert f"reward/{agent}/mean" in line and f"loss/{model}" in line
    # the team's own episode metrics; rollout/* are means over the episodes accepted since
    # the previous line, so a line right after another may have none
    rollout = [x for x in train if "rollout/approved" in x]
    assert rollout and all(0.0 <= x["rollout/proposer_right"] <= 1.0 for x in rollout)
    val = [x for x in lines if "val/tasks" in x]
    assert {x["step"] for x in val} == {0, 2} and all(x["val/tasks"] == 8 for x in val)
    assert all("val/proposer_right" in x for x in val)
    # drmas itself knows nothing of the example: it was loaded from the copy by path
    package = (REPO / "drmas").rglob("*.py")
    assert not any("proposer" in f.read_text() for f in package)
