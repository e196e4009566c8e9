"""Which code a benchmark or study result came from: HEAD and whether the tree had changes.

Every script under benchmarks/ records `git_state()` in its result file, so a number can be
traced to the commit it ran at. Changes under benchmarks/results/ do not count as dirty:
they are the results themselves, which a study writes while it runs.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results/"


def git(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`git -C tree ARGS` (60 s at most), its output as text."""
    return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                          timeout=60)  # fmt: skip


def git_state(tree: Path = REPO) -> dict[str, Any]:
    """{"commit", "dirty", "dirty_paths"} of `tree`: HEAD, whether any file outside
    benchmarks/results/ differs from it (untracked files included), and the first 20 such
    paths. All None/empty when `tree` is not a git checkout (an unpacked archive)."""
    head = git(tree, "rev-parse", "HEAD")
    if head.returncode != 0:
        return {"commit": None, "dirty": None, "dirty_paths": []}
    status = git(tree, "status", "--porcelain", "--untracked-files=all")
    paths = [line[3:] for line in status.stdout.splitlines() if len(line) > 3]
    paths = [p for p in paths if not p.strip('"').startswith(RESULTS)]
    return {"commit": head.stdout.strip(), "dirty": bool(paths), "dirty_paths": paths[:20]}
