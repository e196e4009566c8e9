"""The example team of examples/proposer_critic, trained from outside the package: a copy
of its folder in a temporary directory, run from there with `--config`, exactly as a user
with their own team in their own repository would; then `drmas eval` on the run folder,
on its checkpoint and on data files from two sources."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.integration.conftest import REPO, read_metrics

pytestmark = pytest.mark.slow


def test_example_team_trains_from_its_own_folder_and_is_evaluated(
    tmp_path: Path, model_cache: Path
) -> None:
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

    # drmas eval: the final weights on two data files, reported per source and overall
    for name, lo in (("easy", 1), ("hard", 30)):
        rows = [
            {"question": f"{a}+{a}", "answer": 2 * a, "data_source": name}
            for a in range(lo, lo + 6)
        ]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = _drmas(tmp_path, "eval", str(run_dir), "--data", "easy.jsonl", "--data", "hard.jsonl",
                 "--k", "2", "--n", "3")  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((run_dir / "eval.json").read_text())
    assert report["team"] == "proposer_critic" and report["settings"]["temperature"] == 0.6
    assert {m: w["from"] for m, w in report["weights"].items()} == {
        "proposer": "final", "critic": "final"
    }  # fmt: skip
    assert set(report["sources"]) == {"easy", "hard"}
    for part in (*report["sources"].values(), report["overall"]):
        for key in ("avg@2", "pass@2", "pass@1"):
            assert 0.0 <= part[key] <= 1.0 and part[f"{key}/se"] >= 0.0
        assert part["pass@1"] == pytest.approx(part["avg@2"])  # both: successes / samples
        assert part["pass@2"] >= part["pass@1"] - 1e-9
    assert report["sources"]["easy"]["tasks"] == 6 and report["overall"]["tasks"] == 12
    assert "| easy | 6 |" in out.stdout and "| all | 12 |" in out.stdout
    # a learner checkpoint, exported to a Hugging Face folder first: same weights as final
    out = _drmas(tmp_path, "eval", str(run_dir), "--step", "2", "--k", "2", "--tasks", "4",
                 "--out", "ckpt.json")  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((tmp_path / "ckpt.json").read_text())
    assert report["overall"]["tasks"] == 4 and set(report["sources"]) == {"tasks"}
    for model in ("proposer", "critic"):
        exported = run_dir / "checkpoints" / model / "step-000002" / "hf" / "model.safetensors"
        final, again = (
            load_file(str(run_dir / "models" / model / "model.safetensors")),
            load_file(str(exported)),
        )
        assert all(torch.equal(final[k], again[k]) for k in final)


def _drmas(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", *args], cwd=cwd, capture_output=True,
        text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
