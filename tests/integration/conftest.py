"""Fixtures for tests that run real drmas processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Small, fast settings shared by the end-to-end runs (2 CPU cores in CI).
FAST = [
    "train.steps=4",
    "group_size=4",
    "batch_groups=4",
    "val.every=2",
    "val.num_tasks=8",
    "val.n=2",
    "val.k=2",
    "models.solver.warmstart.steps=60",
    "models.verifier.warmstart.steps=60",
    "broker.heartbeat_timeout_s=4",
    "weights.timeout_s=10",
    "train.progress=true",
]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private builtin-model cache, built once per session by the first run that needs it."""
    return tmp_path_factory.mktemp("drmas-cache")


def drmas(
    *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the drmas CLI as a child process; output captured."""
    return subprocess.run(
        [sys.executable, "-m", "drmas.launch.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def read_metrics(run_dir: Path) -> list[dict]:
    return [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line
    ]


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "broker_summary.json").read_text())
