"""Starts child processes and brings them all down on the first failure.

Each child gets its own process group (start_new_session) and a log file, so stopping a
child stops everything it started: SIGTERM to the group, wait, then SIGKILL. Children
also receive SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG on Linux).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Child:
    name: str
    role: str  # broker | learner | actor
    proc: subprocess.Popen[bytes]
    log_path: Path

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Supervisor:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(
        self, name: str, role: str, argv: list[str], env: dict[str, str] | None = None
    ) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        child = Child(name, role, proc, log_path)
        self.children.append(child)
        return child

    def failed(self) -> Child | None:
        """The first child that exited with an error, if any."""
        for child in self.children:
            code = child.proc.poll()
            if code not in (None, 0):
                return child
        return None

    def alive(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and c.proc.poll() is None]

    def stop(
        self,
        children: list[Child] | None = None,
        grace_s: float = 10.0,
        insist_after_s: float | None = None,
    ) -> None:
        """SIGTERM each child's process group, wait up to grace_s, then SIGKILL. With
        `insist_after_s`, a child still running that long after the first SIGTERM gets a
        second one (a broker takes it as "stop now, wait for nobody")."""
        targets = [c for c in (children or self.children) if c.proc.poll() is None]
        for child in targets:
            _signal_group(child.proc.pid, signal.SIGTERM)
        if insist_after_s is not None:
            insist_by = time.monotonic() + insist_after_s
            for child in targets:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.proc.wait(timeout=max(0.0, insist_by - time.monotonic()))
                if child.proc.poll() is None:
                    _signal_group(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in targets:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.proc.pid, signal.SIGKILL)
                child.proc.wait(timeout=5)


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the launcher dies (even by SIGKILL), so no role
    outlives `drmas train`. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(pid, sig)  # the child leads its own group (start_new_session)
