"""A user's team with a bug that raises in every episode stops `drmas train`: the run
exits nonzero, its console shows the traceback once with the user's file and line, and
the actor gave up after actor.max_failed_groups failed groups in a row (it used to
re-lease failing groups until killed from outside, with nothing on the console). The
actor gives up once at least 20 groups failed in a row over at least actor.min_failing_s
(10 s by default), so the run stops well within a minute of its start."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.integration.conftest import FAST, drmas
from tests.integration.test_supervision import drmas_children_of

pytestmark = pytest.mark.slow

TEAM = '''\
"""The math team with a typo in its own run_episode."""

from drmas.teams.math import MathTeam


class Broken(MathTeam):
    name = "broken"

    async def run_episode(self, task, sampling):
        turns = []
        text, step = await self.call("solver", task, turns, sampling)
        return self.episode_of(text, step)  # line 12: no such method
'''


def test_a_team_that_raises_in_every_episode_stops_the_run(
    tmp_path: Path, model_cache: Path
) -> None:
    team = tmp_path / "broken_team.py"
    team.write_text(TEAM)
    run_dir = tmp_path / "run"
    out = drmas(
        "train", *FAST, f"workflow.target={team}:Broken", "train.steps=50",
        f"run.dir={run_dir}", f"run.cache_dir={model_cache}", timeout=600,
    )  # fmt: skip
    console = out.stdout + out.stderr
    assert out.returncode == 1, console[-4000:]
    # the first failure, in full, once: the user's file and line, then the exception
    assert console.count("Traceback (most recent call last)") == 1, console[-4000:]
    assert f'File "{team}", line 12, in run_episode' in console
    assert "AttributeError: 'Broken' object has no attribute 'episode_of'" in console
    # why the run stopped: the team, the exception, where it was raised
    report = json.loads((run_dir / "logs" / "actor-0.failure.json").read_text())
    assert report["stopped"] and report["team"] == "broken"
    assert report["failed_groups"] >= 20 and report["failing_s"] >= 10.0
    stopped = re.search(
        r"actor-0 stopped \(exit code 3\): the broken team failed (\d+) groups in a row in "
        r"\d+ s on actor-0, each with an exception in its code; the last one: AttributeError",
        console,
    )
    assert stopped and int(stopped[1]) == report["failed_groups"], console[-4000:]
    assert f"(raised at {team}:12 in run_episode)" in console
    # the actor's log: the traceback once, then one line per later failure
    log = (run_dir / "logs" / "actor-0.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1
    assert log.count("failed: AttributeError") == report["failed_groups"] - 1
    assert "drmas train: done" not in console
    assert drmas_children_of(run_dir) == []  # broker and learners stopped too
