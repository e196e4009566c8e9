"""tests/gpu on the GPU machine (scripts/gpu_check.sh sets DRMAS_GPU_OUT): one line per
check appended to $DRMAS_GPU_OUT/summary.txt the moment it ends (PASSED / FAILED / SKIPPED
with the reason and seconds), so a run stopped at its budget still says what it got to.
Elsewhere (no DRMAS_GPU_OUT) nothing is written."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _line(report: pytest.TestReport) -> str | None:
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        return f"SKIPPED {report.nodeid}: {reason.removeprefix('Skipped: ')}"
    if report.failed:
        last = (report.longreprtext.strip().splitlines() or [""])[-1]
        return f"FAILED {report.nodeid} ({report.when}, {report.duration:.1f} s): {last[:300]}"
    if report.when == "call":
        return f"PASSED {report.nodeid} ({report.duration:.1f} s)"
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    out = os.environ.get("DRMAS_GPU_OUT")
    line = _line(report) if out else None
    if out and line:
        with (Path(out) / "summary.txt").open("a") as f:
            f.write(line + "\n")
