"""examples/openai_team, as a user with a program of their own would run it: a copy of the
folder elsewhere, `drmas train --config` from there (the program and its warm-start
transcripts loaded by path), then `drmas eval` on the run folder."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.integration.conftest import REPO, check_accounting, read_metrics, read_summary

pytestmark = pytest.mark.slow


def drmas(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", *args], cwd=cwd, capture_output=True,
        text=True, timeout=900, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def test_the_openai_example_trains_from_its_own_folder_and_is_evaluated(tmp_path: Path) -> None:
    example = tmp_path / "my_agents"
    shutil.copytree(REPO / "examples" / "openai_team", example)
    run_dir = tmp_path / "run"
    out = drmas(tmp_path, "train", "--config", "my_agents/config.yaml", "train.steps=2",
                "group_size=4", "batch_groups=2", "val.every=2", "val.num_tasks=8",
                "models.policy.warmstart.steps=60", f"run.dir={run_dir}",
                f"run.cache_dir={tmp_path / 'cache'}")  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["workflow"]["target"] == f"{example / 'program.py'}:episode"
    assert (
        saved["models"]["policy"]["warmstart"]["workflow"] == f"{example / 'transcripts.py'}:SOURCE"
    )
    train = [x for x in read_metrics(run_dir) if "val/tasks" not in x]
    assert [x["step"] for x in train] == [1, 2]
    assert all("reward/solver/mean" in x and "reward/checker/mean" in x for x in train)
    check_accounting(read_summary(run_dir), batch_groups=2)
    # the program imports nothing of drmas (its warm-start transcripts may)
    tree = ast.parse((example / "program.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported == {"re"}
    out = drmas(tmp_path, "eval", str(run_dir), "--k", "2", "--tasks", "8")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((run_dir / "eval.json").read_text())
    assert report["overall"]["tasks"] == 8 and 0.0 <= report["overall"]["avg@2"] <= 1.0
