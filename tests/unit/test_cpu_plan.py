"""CPU threads of the processes `drmas train` starts, and the broker's CPU book."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from drmas.broker.cpu import CpuBook
from drmas.config import load_config
from drmas.launch.train import thread_plan
from drmas.learners.entry import cpu_threads


@pytest.mark.parametrize(
    ("cpus", "overrides", "threads"),
    [
        (2, [], 1),  # 2 learners + 1 actor on 2 cores: 1 each, never 2 spinning per learner
        (16, [], 5),  # 16 // 3
        (16, ["actor.num_actors=3"], 3),  # 16 // 5
        (16, ["learner.world_size=2"], 3),  # 2 models x 2 ranks + 1 actor: 16 // 5
        (1, ["actor.num_actors=4"], 1),  # never 0
        # synchronous: learners and actors take turns, so each side has every core
        (2, ["algorithm.max_staleness=0"], 1),  # the 2 learners train at once: 1 each
        (2, ["algorithm.max_staleness=0", "experiment=tiny_math_shared"], 2),  # 1 learner
        (16, ["algorithm.max_staleness=0", "actor.num_actors=4"], 4),  # 4 actors at once
    ],
)
def test_thread_plan_shares_the_cpus_among_learner_ranks_and_actors(
    monkeypatch: pytest.MonkeyPatch, cpus: int, overrides: list[str], threads: int
) -> None:
    monkeypatch.delenv("DRMAS_TORCH_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(cpus)))
    assert thread_plan(load_config(overrides)) == threads


def test_drmas_torch_threads_wins_over_the_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DRMAS_TORCH_THREADS", "4")
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1})
    assert thread_plan(load_config([])) == 4


def test_a_learner_takes_its_setting_then_the_plan_then_torchs_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DRMAS_TORCH_THREADS", "3")
    assert cpu_threads(2) == 2  # learner.threads set: it wins
    assert cpu_threads(0) == 3  # auto: the plan drmas train handed down
    monkeypatch.delenv("DRMAS_TORCH_THREADS")
    assert cpu_threads(0) == 0  # started alone: keep torch's default


def test_cpu_book_sums_per_kind_and_reports_busy_fractions() -> None:
    book = CpuBook()
    book.add("group_result", 0.002)
    book.add("group_result", 0.004)
    book.add("heartbeat", 0.0001)
    time.sleep(0.05)
    now = time.monotonic()
    summary = book.summary(now)
    by_kind = summary["by_kind"]
    assert isinstance(by_kind, dict) and list(by_kind) == ["group_result", "heartbeat"]
    assert by_kind["group_result"]["count"] == 2
    assert by_kind["group_result"]["us_each"] == pytest.approx(3000)
    assert summary["cpu_s"] == pytest.approx(0.0061)
    first = book.busy_since_last_line(now)
    assert first == pytest.approx(0.0061 / (now - book.started))
    book.add("heartbeat", 0.001)
    assert book.busy_since_last_line(now + 0.1) == pytest.approx(0.01)  # only what came since


@pytest.mark.parametrize("value", ["x", "0", "-2", "1.5"])
def test_a_bad_drmas_torch_threads_is_refused_saying_what_to_set(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("DRMAS_TORCH_THREADS", value)
    with pytest.raises(ValueError, match=r"DRMAS_TORCH_THREADS=.*whole number of threads >= 1"):
        thread_plan(load_config([]))
    with pytest.raises(ValueError, match="whole number"):
        cpu_threads(0)
    assert cpu_threads(3) == 3  # learner.threads set: the variable is not read


def test_drmas_train_refuses_a_bad_variable_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from drmas.launch.train import train

    monkeypatch.setenv("DRMAS_TORCH_THREADS", "two")
    run_dir = tmp_path / "run"
    assert train(load_config([f"run.dir={run_dir}"])) == 2
    assert "DRMAS_TORCH_THREADS='two'" in capsys.readouterr().err
    assert not run_dir.exists()
