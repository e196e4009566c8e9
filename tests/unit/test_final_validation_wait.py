"""`drmas train` after its learners finished: it waits for the broker's final validation
round (the broker exits once the round is in), bounded by val.final_timeout_s, and stops
at once on a signal or a failing child. Real child processes under the launcher's
Supervisor stand in for the broker and an actor."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from drmas.launch.progress import Progress
from drmas.launch.supervisor import Supervisor
from drmas.launch.train import _await_broker

SLEEPS = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    supervisor = Supervisor(tmp_path)
    yield supervisor
    supervisor.stop(grace_s=2.0)


def wait(sup: Supervisor, tmp_path: Path, signals: list[int], timeout_s: float) -> int:
    return _await_broker(sup, Progress(tmp_path, ["a"], 1, enabled=False), signals, timeout_s)


def test_a_broker_that_finishes_its_round_ends_the_wait(sup: Supervisor, tmp_path: Path) -> None:
    sup.start("broker", "broker", [sys.executable, "-c", "import time; time.sleep(0.5)"])
    assert wait(sup, tmp_path, [], 60.0) == 0
    assert not sup.alive("broker")


def test_the_wait_is_bounded_and_says_so(
    sup: Supervisor, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup.start("broker", "broker", SLEEPS)
    assert wait(sup, tmp_path, [], 0.5) == 0
    err = capsys.readouterr().err
    assert "did not finish within val.final_timeout_s=0.5 s" in err
    assert "drmas evaluate" in err


def test_a_signal_stops_the_wait(
    sup: Supervisor, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup.start("broker", "broker", SLEEPS)
    assert wait(sup, tmp_path, [15], 60.0) == 130
    assert "interrupted during the final validation" in capsys.readouterr().err


def test_a_child_failing_during_the_round_fails_the_run(
    sup: Supervisor, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sup.start("broker", "broker", SLEEPS)
    actor = sup.start(
        "actor-0", "actor", [sys.executable, "-c", "print('boom'); raise SystemExit(3)"]
    )
    actor.proc.wait(timeout=60)
    assert wait(sup, tmp_path, [], 60.0) == 1
    err = capsys.readouterr().err
    assert "actor-0 failed during the final validation" in err and "boom" in err
