"""drmas report's statistics: spikes, norm summaries, validation picks, older runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from drmas.launch.report_stats import load_run, norm_stats, spikes, validation_stats


def test_spike_is_three_times_the_median_of_the_previous_ten() -> None:
    values = [1.0, 1.1, 0.9, 1.0, 3.5, 1.0, 2.9, float("nan"), 40.0, 1.0]
    # index 4: 3.5 > 3 x median(1, 1.1, 0.9, 1) = 3; index 6: 2.9 < 3 x 1.0; NaN is no spike
    assert spikes(values) == [4, 8]
    assert spikes([5.0, 100.0]) == []  # fewer than 3 earlier values: no baseline yet


def test_norm_stats() -> None:
    xs = [float(i) for i in range(1, 21)]
    ys = [1.0] * 19 + [10.0]
    s = norm_stats(xs, ys)
    assert (s["max"], s["median"], s["p95"], s["spikes"], s["spike_steps"]) == (
        10.0,
        1.0,
        1.0,
        1,
        [20],
    )
    assert norm_stats([1.0], [math.nan]) == {"steps": 1, "finite": 0}


def test_older_run_without_config_or_standard_errors(tmp_path: Path) -> None:
    lines = [
        {"step": 1, "grad_norm/m": 0.5, "reward/a/mean": 0.1},
        {"step": 0, "val/tasks": 8.0, "val/avg@4": 0.25},
        {"step": 2, "grad_norm/m": 0.7, "reward/a/mean": 0.2},
        {"step": 2, "val/tasks": 8.0, "val/avg@4": 0.5},
    ]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 3, "grad'  # killed mid-write
    (tmp_path / "metrics.jsonl").write_text(text)
    run = load_run(tmp_path)
    assert run.label == tmp_path.name and len(run.steps) == 2 and len(run.validation) == 2
    v = validation_stats(run)["val/avg@4"]
    assert v["final"] == {"step": 2, "value": 0.5, "se": None} and v["first"]["value"] == 0.25


def test_not_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no metrics\.jsonl"):
        load_run(tmp_path)


def test_labels_name_one_seed_when_a_seed_study_varies_them_together(tmp_path: Path) -> None:
    from drmas.launch.report_stats import label_of

    def config(order: int | None, engine: int, warm: int) -> dict:
        return {"algorithm": {"advantage": {"mode": "agent"}, "max_staleness": 0},
                "task": {"seed": 0, "order_seed": order}, "actor": {"engine": {"seed": engine}},
                "models": {"solver": {"warmstart": {"seed": warm}}}}  # fmt: skip

    assert label_of(config(None, 0, 0), tmp_path) == "agent seed 0 η=0 [solver]"
    assert label_of(config(3, 3, 3), tmp_path) == "agent seed 0/3/3/3 η=0 [solver]"
    assert label_of(config(0, 1, 0), tmp_path) == "agent seed 0/0/1/0 η=0 [solver]"
