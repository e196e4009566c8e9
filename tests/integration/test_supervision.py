"""drmas train brings every process down on a child's failure. (On Ctrl-C: in
test_elastic.py's attach test, which stops its held-open run that way.)"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.integration.conftest import FAST, drmas

pytestmark = pytest.mark.slow


def drmas_children_of(run_dir: Path) -> list[psutil.Process]:
    """Live processes started for this run (their command line names its config)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(run_dir / "config.yaml") in cmdline:
            found.append(proc)
    return found


def test_a_failing_child_stops_the_run_and_names_itself(tmp_path: Path, model_cache: Path) -> None:
    run_dir = tmp_path / "run"
    # the actor fails at start (its SGLang engine finds no server at the URL: port 9 on
    # loopback, where nothing listens; a config check cannot know that); broker and
    # learners must stop too
    out = drmas(
        "train", *FAST, "actor.engine.name=sglang", "actor.engine.sglang_url=http://127.0.0.1:9",
        f"run.dir={run_dir}", f"run.cache_dir={model_cache}", timeout=300,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "actor-0 exited with code 1" in out.stderr
    assert "SGLang server at http://127.0.0.1:9: /health failed" in out.stderr  # its log tail
    assert drmas_children_of(run_dir) == []
