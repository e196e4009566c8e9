"""Fixtures for tests that run real drmas processes on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests.integration.slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

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
    # margin for a loaded 2-core machine: a false "lost" would break exact loss counts
    "broker.heartbeat_timeout_s=10",
    "weights.timeout_s=10",
    "train.progress=true",
]


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


# ---------------------------------------------------------- a run in the background
T = TypeVar("T")


def start_train(run_dir: Path, cache: Path, *extra: str) -> subprocess.Popen[str]:
    """`drmas train` with the FAST settings as a background child (output piped)."""
    return subprocess.Popen(
        [sys.executable, "-m", "drmas.launch.cli", "train", *FAST, *extra,
         f"run.dir={run_dir}", f"run.cache_dir={cache}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def wait_for(
    pred: Callable[[], T], timeout: float, what: str, run: subprocess.Popen[str] | None = None
) -> T:
    """Poll `pred` until it is truthy; fail early if `run` (drmas train) has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if run is not None and run.poll() is not None:
            raise AssertionError(f"drmas train ended (code {run.returncode}) before: {what}")
        value = pred()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(what)


def actor_hello(run_dir: Path, cid: str, models: list[str], version: int | None = None) -> Any:
    """An actor's Hello proven with the run's actor secret (RUN_DIR/actor.secret): a fake
    actor of these tests stands for a compromised or buggy actor that holds the key."""
    from drmas.protocol import PROTOCOL_VERSION
    from drmas.protocol.messages import Hello
    from drmas.transports.learner_secret import actor_proof

    secret = (run_dir / "actor.secret").read_text().strip().encode()
    given = actor_proof(secret, cid)
    return Hello(
        "actor", cid, PROTOCOL_VERSION if version is None else version, models, proof=given
    )


def broker_address(run_dir: Path, timeout: float = 240) -> str:
    def address() -> str:
        path = run_dir / "config.yaml"
        return yaml.safe_load(path.read_text())["broker"]["address"] if path.exists() else ""

    return wait_for(address, timeout, "drmas train wrote no config.yaml")


def status(address: str) -> dict[str, Any]:
    # a loaded machine may take seconds to start the CLI and the broker to answer
    out = drmas("status", address, "--json", "--timeout", "30", timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def stop_all(*procs: subprocess.Popen[str] | None) -> None:
    """Only the processes a test started itself, each with SIGTERM (`drmas train` stops its
    own children on it), then a wait."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)


HELD_OPEN = "train.steps=100000"
"""A run that only ends when its test stops it (stop_run): a test whose late actor must find
the run still going holds it open by construction, not by a step count tuned to the
machine's speed (a loaded machine once finished a 12-step run before the actor arrived)."""


def stop_run(proc: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout: float = 120) -> str:
    """Stop a held-open `drmas train` as a user would (SIGTERM, or SIGINT: Ctrl-C) once the
    test's checks are done; it exits 130 with every child stopped. Its output."""
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 130, out[-4000:]
    return out


def check_accounting(summary: dict[str, Any], batch_groups: int = 4) -> dict[str, int]:
    """Nothing lost, nothing counted twice, in a run stopped at any step: every issued lease
    ended one way or is still out, no group trained twice, no weight load mismatched, and
    every version a model reached is one whole batch. The counters."""
    c = summary["counters"]
    assert summary["leases"]["balanced"] == 1, summary["leases"]
    assert c.get("groups_trained_twice", 0) == 0, c
    assert c.get("weight_digest_mismatch", 0) == 0, c
    for model, version in summary["versions"].items():
        assert summary["trained_groups"][model] == version * batch_groups, summary
    return c


def versions(address: str) -> dict[str, int]:
    """Each model's version, from `drmas status`."""
    return {m: s["version"] for m, s in status(address)["models"].items()}


def finish(proc: subprocess.Popen[str], timeout: float = 420) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def retriever_healthy(url: str) -> bool:
    """True once a `drmas retriever` at `url` answers /health with status ok."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200 and json.loads(response.read())["status"] == "ok"
    except OSError:
        return False
