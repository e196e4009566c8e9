"""The head-node side of docs/deploy.md's Slurm flow, as the Slurm tests run it: CURVE keys
and `drmas prepare deploy=slurm` into a run folder, `drmas broker` in the background, and
`drmas status` of the run. The jobs themselves are submitted with
tests/integration/slurm_cluster.py's `submit`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from drmas.transports.ports import free_port
from tests.integration.conftest import REPO, drmas


def prepare_run(
    tmp_path: Path, model_cache: Path, overrides: list[str], clients: str
) -> tuple[Path, dict[str, str]]:
    """`drmas keys RUN/keys --clients CLIENTS` then `drmas prepare deploy=slurm` into
    tmp_path/run with the broker on a free loopback port: the run folder and the
    environment (DRMAS_BROKER_ADDRESS) every head-node command of the run gets."""
    run_dir = tmp_path / "run"
    keys = run_dir / "keys"
    address = {"DRMAS_BROKER_ADDRESS": f"tcp://127.0.0.1:{free_port()}"}
    made = drmas("keys", str(keys), "--clients", clients, timeout=120)
    assert made.returncode == 0, made.stderr
    prep = drmas(
        "prepare", "deploy=slurm", f"run.dir={run_dir}", f"security.keys_dir={keys}",
        *overrides, f"run.cache_dir={model_cache}", env=address,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr[-3000:]
    return run_dir, address


def start_broker(
    run_dir: Path, log: Path, address: dict[str, str], *extra: str
) -> subprocess.Popen[bytes]:
    """`drmas broker --config RUN/config.yaml [EXTRA]` in the background, output to `log`."""
    with log.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "drmas.launch.cli", "broker", "--config",
             str(run_dir / "config.yaml"), *extra],
            cwd=REPO, env={**os.environ, **address}, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip


def status(run_dir: Path) -> dict[str, Any]:
    """`drmas status RUN --json` with the observer key (the keys need `observer`)."""
    out = drmas("status", str(run_dir), "--json", "--client", "observer", "--timeout", "10",
                timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))
