"""Kill a learner after its first checkpoint; `drmas train run.resume=RUN_DIR` finishes the run.

Observed, not assumed: the learner we SIGKILL is found by its command line (it names this
run's config.yaml and its model); the optimizer digest the resumed learner logs is compared
with the one logged at save AND with one this test computes itself from the checkpoint
files; the broker's snapshot says which tasks were not held by the checkpoints, and the
resumed broker must requeue exactly those and continue its cursor where it stood.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import FAST, REPO, drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

STEPS = 6
MODELS = ("solver", "verifier")


def learner_process(run_dir: Path, model: str) -> psutil.Process | None:
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(run_dir / "config.yaml") in cmdline and "learner" in cmdline and model in cmdline:
            return proc
    return None


def digest_of_files(folder: Path) -> str:
    """sha256 of the optimizer state in the checkpoint's files (world size 1: shard =
    tensor), read with safetensors alone, in the order the learner documents: parameters
    by name, state keys by name, float32 bytes."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in load_file(folder / "rank-00000.safetensors").items():
        if key.startswith("optim/"):
            name, _, what = key.removeprefix("optim/").rpartition("/")
            state.setdefault(name, {})[what] = value
    h = hashlib.sha256()
    for name in sorted(state):
        for key, value in sorted(state[name].items()):
            h.update(f"{name}/{key}".encode())
            h.update(value.to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def test_kill_a_learner_then_resume(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    settings = [*FAST, f"train.steps={STEPS}", "checkpoint.every=2", f"run.cache_dir={model_cache}"]
    stderr = tmp_path / "train.stderr"
    with stderr.open("w") as err_file:  # files, not pipes: nobody reads them while it runs
        train = subprocess.Popen(
            [sys.executable, "-m", "drmas.launch.cli", "train", *settings, f"run.dir={run_dir}"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=err_file, text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    try:
        first = run_dir / "checkpoints" / "solver" / "step-000002" / "manifest.json"
        deadline = time.monotonic() + 240
        while not first.exists():
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            assert train.poll() is None, stderr.read_text()[-3000:]
            time.sleep(0.2)
        victim = learner_process(run_dir, "solver")
        assert victim is not None
        victim.send_signal(signal.SIGKILL)
        train.wait(timeout=120)
    finally:
        if train.poll() is None:
            train.kill()
    err = stderr.read_text()
    assert train.returncode == 1, err[-3000:]
    assert "learner-solver-0 exited with code -9" in err
    assert f"resume with: drmas train run.resume={run_dir}" in err
    named = dict(re.findall(r"(\w+) v(\d+) \(", err.split("last complete checkpoints:")[1]))
    versions = {m: int(named[m]) for m in MODELS}
    assert versions["solver"] >= 2 and versions["solver"] < STEPS, err[-2000:]
    assert all(v % 2 == 0 for v in versions.values())

    snap = json.loads((run_dir / "checkpoints" / "broker.json").read_text())
    not_held = [t for _, t in snap["pending"]]
    not_held += [t for m, v, _, t in snap["trained_log"] if v > versions[m]]
    saved_digest = {}
    for m, v in versions.items():
        if v:
            folder = run_dir / "checkpoints" / m / f"step-{v:06d}"
            manifest = json.loads((folder / "manifest.json").read_text())
            saved_digest[m] = manifest["optim_digests"][0]
            assert digest_of_files(folder) == saved_digest[m]  # the files hold what was saved
    before = [x["step"] for x in read_metrics(run_dir) if "val/tasks" not in x]

    resumed_at = time.time()
    again = drmas("train", *settings, f"run.resume={run_dir}", timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    logs = run_dir / "logs"
    for m, v in versions.items():
        learner_log = (logs / f"learner-{m}-0.log").read_text()
        assert f"{m} rank 0/1 ready at version {v} " in learner_log  # versions continue
        if v:
            loaded = re.findall(rf"resumed from checkpoint .* at v{v} \(optimizer digest (\w+)\)",
                                learner_log)  # fmt: skip
            assert loaded == [saved_digest[m]]  # optimizer state after load == saved
    broker_log = (logs / "broker.log").read_text()
    resumed = re.search(r"cursor epoch (\d+) index (\d+), (\d+) leases .* requeued tasks (.*)$",
                        broker_log, re.M)  # fmt: skip
    assert resumed is not None
    cursor = (int(resumed.group(1)), int(resumed.group(2)))
    assert cursor == (snap["source"]["epoch"], snap["source"]["index"])  # cursor continues
    assert cursor[1] > 0
    assert sorted(json.loads(resumed.group(4))) == sorted(set(not_held))  # only those return

    finished = drmas("train", f"run.resume={run_dir}", timeout=120)  # nothing left to do
    assert finished.returncode == 0 and "is finished" in finished.stderr, finished.stderr
    assert f"train.steps={2 * STEPS}" in finished.stderr  # and how to extend it

    lines = read_metrics(run_dir)
    train_steps = [x["step"] for x in lines if "val/tasks" not in x]
    assert train_steps == list(range(1, STEPS + 1))  # appended, increasing, nothing twice
    low = min(versions.values())
    assert all(x["time_s"] > resumed_at for x in lines if "val/tasks" not in x and x["step"] > low)
    assert before[:low] == list(range(1, low + 1))
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert summary["done"] and summary["leases"]["balanced"] == 1
    assert c["resumes"] == 1 and c.get("groups_trained_twice", 0) == 0
    assert c["leases_requeued_on_resume"] == snap["outstanding_leases"]
    assert summary["trained_groups"] == {m: STEPS * 4 for m in MODELS}
    assert c.get("weight_digest_mismatch", 0) == 0 and c["weight_digest_match"] >= 1
    final = json.loads((run_dir / "checkpoints" / "broker.json").read_text())
    assert final["versions"] == {m: STEPS for m in MODELS}
    assert final["source"]["index"] >= cursor[1]
    for m in MODELS:
        kept = sorted(p.name for p in (run_dir / "checkpoints" / m).glob("step-*"))
        assert kept == ["step-000004", "step-000006"]  # keep=2, complete ones only
