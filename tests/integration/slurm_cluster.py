"""The `slurm_cluster` fixture: a real one-node Slurm (munged, slurmctld, slurmd) started by
scripts/slurm_cluster.sh once per test session, for the tests marked `slurm`.

Where the Slurm binaries are missing the tests are skipped with the reason, except in CI
(CI=true), where a missing or failed controller fails them: CI installs slurm-wlm and
munge (.ci/run), so a skip there would hide a broken Slurm path. The daemons are stopped
(their jobs cancelled first) when the session ends, whatever the tests did.

The node offers 16 CPUs, 128 GB and 8 GPUs whatever the machine has (the script's
DRMAS_SLURM_CPUS, DRMAS_SLURM_MEM_MB and DRMAS_SLURM_GPUS): 2 learner groups of 2 ranks and
2 actors then run at once on a 2-core CI runner, a job with configs/slurm's default
resources is accepted, and jobs may ask for GPUs as on a GPU cluster. The GPUs are empty
files: Slurm schedules and accounts for them, nothing uses them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "scontrol", "scancel", "sbatch")
CPUS = 16
MEM_MB = 128 * 1024
GPUS = 8
START_TIMEOUT_S = 60
SMALL_JOB = ["hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1"]
"""What the tests add to docs/deploy.md's commands: jobs that fit the test node's 16 CPUs
(1 CPU per task also gives each role 1 torch thread on the 2-core CI runner)."""
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY")


@dataclass
class SlurmCluster:
    """A running one-node cluster: its folder and the environment that points Slurm's
    commands at it (SLURM_CONF)."""

    dir: Path
    env: dict[str, str]
    version: str

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout
        )

    def jobs(self) -> list[dict[str, str]]:
        """Every job the controller still knows (finished ones for MinJobAge = 10 minutes),
        one dict of `scontrol show job --oneliner` fields each; array elements one each."""
        out = self.run("scontrol", "show", "job", "--oneliner")
        if out.returncode != 0 and "No jobs" not in out.stdout + out.stderr:
            raise AssertionError(f"scontrol show job failed: {out.stderr}")
        return [_fields(line) for line in out.stdout.splitlines() if line.startswith("JobId=")]

    def jobs_logging_to(self, folder: Path) -> list[dict[str, str]]:
        """The jobs whose output goes under `folder` (one test's submissions)."""
        return [j for j in self.jobs() if j.get("StdOut", "").startswith(str(folder))]

    def wait_ended(self, folder: Path, count: int, timeout: float) -> list[dict[str, str]]:
        """Wait until `count` jobs logging under `folder` have all ended; their fields."""
        deadline = time.monotonic() + timeout
        jobs: list[dict[str, str]] = []
        while time.monotonic() < deadline:
            jobs = self.jobs_logging_to(folder)
            if len(jobs) >= count and all(j["JobState"] in ENDED for j in jobs):
                return jobs
            time.sleep(1)
        raise TimeoutError(
            f"{count} jobs under {folder} not ended after {timeout}s: "
            f"{[(j['JobId'], j['JobState']) for j in jobs]}"
        )

    def logs(self) -> str:
        """The daemons' log tails, for a failing test's output."""
        return "\n".join(
            f"--- {log.name}:\n{log.read_text(errors='replace')[-3000:]}"
            for log in sorted((self.dir / "log").glob("*.log"))
        )


def submit(cluster: SlurmCluster, logs: Path, *args: str, out: Path) -> subprocess.Popen[bytes]:
    """`python -m drmas.launch.slurm -m ARGS` in the background, as docs/deploy.md runs it;
    it waits for its jobs and exits 0 once each returned. Job logs go under `logs`."""
    env = {
        **cluster.env,
        "PYTHONUNBUFFERED": "1",
        "DRMAS_SLURM_LOGS": str(logs),
        "DRMAS_VENV": str(Path(sys.executable).parents[1]),
    }
    with out.open("w") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "drmas.launch.slurm", "-m", *args],
            cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
        )  # fmt: skip


def wait_all(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every process ended, or one failed (no point waiting for the rest)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c for c in codes):
            return
        time.sleep(1)
    raise TimeoutError(f"submitting commands still waiting after {timeout}s")


def job_logs(logs: Path, tail: int | None = None) -> str:
    """Every job's submitit logs (stdout and stderr of each task), each cut to its last
    `tail` characters if given."""
    return "\n".join(
        f"--- {p.relative_to(logs)}:\n{p.read_text(errors='replace')[-(tail or 0) :]}"
        for p in sorted(logs.rglob("*.out")) + sorted(logs.rglob("*.err"))
    )


def _fields(line: str) -> dict[str, str]:
    return dict(tok.split("=", 1) for tok in line.split() if "=" in tok)


def _free_port_pair() -> int:
    """A port p with p and p + 1 free (slurmctld's and slurmd's)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports found for slurmctld and slurmd")


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: .ci/run installs slurm-wlm and munge, so this fails)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    missing = [b for b in BINARIES if shutil.which(b) is None]
    if missing:
        _unavailable(f"Slurm not installed ({', '.join(missing)} missing): apt-get install "
                     "slurm-wlm munge")  # fmt: skip
    folder = tmp_path_factory.mktemp("slurm")
    env = {
        **os.environ,
        "SLURM_CONF": str(folder / "slurm.conf"),
        "DRMAS_SLURM_CPUS": str(CPUS),
        "DRMAS_SLURM_MEM_MB": str(MEM_MB),
        "DRMAS_SLURM_GPUS": str(GPUS),
        "DRMAS_SLURM_PORT": str(_free_port_pair()),
        "DRMAS_SLURM_TIMEOUT": str(START_TIMEOUT_S),
    }
    try:
        start = subprocess.run(
            ["bash", str(SCRIPT), "start", str(folder)],
            env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S + 90,
        )  # fmt: skip
        if start.returncode != 0:
            _unavailable(f"the one-node Slurm did not come up:\n{start.stdout}{start.stderr}")
        version = subprocess.run(
            ["slurmctld", "-V"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        yield SlurmCluster(folder, env, version)
    finally:
        subprocess.run(
            ["bash", str(SCRIPT), "stop", str(folder)], env=env, timeout=4 * START_TIMEOUT_S
        )
