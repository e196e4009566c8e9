"""Numbers of `drmas report`: one run folder -> its metric series and spike statistics.

    RUN_DIR/metrics.jsonl, RUN_DIR/config.yaml ── load_run ──> Run
    Run ── spike_stats / validation_stats ──> summary.json / summary.md (report.py)

Pure Python (no matplotlib, no torch), so older runs with missing keys and the statistics
are unit-testable on their own.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SPIKE_FACTOR = 3.0
"""A step is a spike when its norm exceeds this many times the median of the previous
SPIKE_WINDOW steps."""
SPIKE_WINDOW = 10


@dataclass
class Run:
    """One run folder's training lines (one per step) and validation lines."""

    path: Path
    label: str
    steps: list[dict[str, float]]
    validation: list[dict[str, float]]
    config: dict[str, Any] = field(default_factory=dict)

    def series(
        self, key: str, lines: list[dict[str, float]] | None = None
    ) -> tuple[list[float], list[float]]:
        """(steps, values) of `key` where present and finite-or-nan (inf kept out)."""
        xs, ys = [], []
        for line in self.steps if lines is None else lines:
            value = line.get(key)
            if isinstance(value, (int, float)) and "step" in line and not math.isinf(value):
                xs.append(float(line["step"]))
                ys.append(float(value))
        return xs, ys

    def keys(self, prefix: str, suffix: str = "") -> list[str]:
        """Metric keys `prefix<name>suffix` found in any training line, sorted."""
        found = {
            k for line in self.steps for k in line if k.startswith(prefix) and k.endswith(suffix)
        }
        return sorted(found)


def load_run(path: str | Path) -> Run:
    folder = Path(path)
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{folder}: no metrics.jsonl (is it a drmas run folder?)")
    steps: list[dict[str, float]] = []
    validation: list[dict[str, float]] = []
    raw_lines = metrics.read_text().splitlines()
    for n, raw in enumerate(raw_lines, 1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            if n == len(raw_lines):  # the last line of a run killed mid-write
                break
            raise ValueError(f"{metrics} line {n} is not JSON") from None
        (validation if "val/tasks" in line else steps).append(line)
    config: dict[str, Any] = {}
    if (folder / "config.yaml").is_file():
        config = yaml.safe_load((folder / "config.yaml").read_text()) or {}
    return Run(folder, label_of(config, folder), steps, validation, config)


def label_of(config: dict[str, Any], folder: Path) -> str:
    """Advantage mode, seeds and staleness from the resolved config; the folder name when
    the config is missing."""
    if not config:
        return folder.name
    algorithm = config.get("algorithm", {})
    mode = algorithm.get("advantage", {}).get("mode", "?")
    task = config.get("task", {})
    order = task.get("order_seed")
    seeds = [
        task.get("seed", 0),
        task.get("seed", 0) if order is None else order,
        config.get("actor", {}).get("engine", {}).get("seed", 0),
        *sorted({m.get("warmstart", {}).get("seed", 0) for m in config.get("models", {}).values()}),
    ]
    # one number when every seed agrees (a seed study), else task/order/sampling/warm start
    seed = str(seeds[0]) if len(set(seeds)) == 1 else "/".join(map(str, seeds))
    eta = algorithm.get("max_staleness", "?")
    models = ",".join(sorted(config.get("models", {})))
    return f"{mode} seed {seed} η={eta} [{models}]"


def distinct_labels(runs: list[Run]) -> None:
    """Runs whose labels coincide get their folder name appended."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    for run in runs:
        if counts[run.label] > 1:
            run.label = f"{run.label} ({run.path.name})"


def spikes(
    values: list[float], factor: float = SPIKE_FACTOR, window: int = SPIKE_WINDOW
) -> list[int]:
    """Indices whose value exceeds `factor` x the median of the `window` values before it
    (finite ones; at least 3 of them)."""
    out = []
    for i, value in enumerate(values):
        before = [v for v in values[max(0, i - window) : i] if math.isfinite(v)]
        if len(before) >= 3 and math.isfinite(value) and value > factor * statistics.median(before):
            out.append(i)
    return out


def norm_stats(xs: list[float], ys: list[float]) -> dict[str, Any]:
    finite = sorted(v for v in ys if math.isfinite(v))
    if not finite:
        return {"steps": len(ys), "finite": 0}
    p95 = finite[min(len(finite) - 1, math.ceil(0.95 * len(finite)) - 1)]
    spike_at = spikes(ys)
    return {
        "steps": len(ys),
        "finite": len(finite),
        "max": finite[-1],
        "median": statistics.median(finite),
        "p95": p95,
        "spikes": len(spike_at),
        "spike_steps": [int(xs[i]) for i in spike_at],
    }


def spike_stats(run: Run) -> dict[str, dict[str, Any]]:
    """Per model (`grad_norm/<m>`, plus its skipped non-finite steps) and per agent
    (`agent_grad_norm/<a>`)."""
    out: dict[str, dict[str, Any]] = {}
    for key in run.keys("grad_norm/"):
        model = key.split("/", 1)[1]
        stats = norm_stats(*run.series(key))
        _, skipped = run.series(f"skipped_steps/{model}")
        stats["skipped_nonfinite"] = int(sum(skipped)) if skipped else None
        out[f"model {model}"] = stats
    for key in run.keys("agent_grad_norm/"):
        out[f"agent {key.split('/', 1)[1]}"] = norm_stats(*run.series(key))
    return out


def validation_stats(run: Run) -> dict[str, dict[str, Any]]:
    """For each val/avg@k and val/pass@k: the final and the best round, each with its
    step and standard error."""
    keys = sorted(
        {k for line in run.validation for k in line if k.startswith(("val/avg@", "val/pass@"))}
        - {k for line in run.validation for k in line if k.endswith("/se")}
    )
    keys = [k for k in keys if k.count("/") == 1]  # not the per-source ones
    out: dict[str, dict[str, Any]] = {}
    for key in keys:
        rounds = [line for line in run.validation if key in line]
        if not rounds:
            continue
        final = rounds[-1]
        best = max(rounds, key=lambda line: line[key])

        def point(line: dict[str, float], k: str = key) -> dict[str, Any]:
            return {"step": line.get("step"), "value": line[k], "se": line.get(f"{k}/se")}

        out[key] = {"final": point(final), "best": point(best), "first": point(rounds[0])}
    return out


def time_stats(run: Run) -> dict[str, Any]:
    """Where the run's time went. Learners, per model: seconds training (forward, backward,
    optimizer), waiting for batches and publishing weights, summed over the steps, and as
    a fraction of the seconds between the first and the last step line. Actors (from
    logs/*.time.json, written at exit): seconds generating, waiting for leases and loading
    weights, and the fraction generating. The broker (broker_summary.json): its CPU
    seconds per message type and busy fraction. Missing pieces are left out."""
    times = [line["time_s"] for line in run.steps if "time_s" in line]
    span = max(times) - min(times) if len(times) > 1 else 0.0
    out: dict[str, Any] = {"span_s": span, "learners": {}, "actors": {}}
    models = {k.split("/", 1)[1] for line in run.steps for k in line if k.startswith("train_s/")}
    for model in sorted(models):
        parts = {
            part: sum(float(line.get(f"{part}/{model}", 0.0)) for line in run.steps[1:])
            for part in ("train_s", "batch_wait_s", "weight_sync_s")
        }  # the first line's time holds start-up: steps after it, as span does
        out["learners"][model] = parts | (
            {"busy_fraction": (parts["train_s"] + parts["weight_sync_s"]) / span} if span else {}
        )
    for book in sorted((run.path / "logs").glob("*.time.json")):
        with contextlib.suppress(OSError, ValueError):
            out["actors"][book.name.removesuffix(".time.json")] = json.loads(book.read_text())
    with contextlib.suppress(OSError, ValueError, KeyError):
        out["broker"] = json.loads((run.path / "broker_summary.json").read_text())["cpu"]
    return out
