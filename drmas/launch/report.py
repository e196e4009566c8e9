"""`drmas report RUN_DIR [RUN_DIR ...] --out DIR`: plots and spike statistics of runs.

    run folders ── report_stats.load_run ──> Runs
    Runs ── panels (matplotlib, Agg) ──> DIR/*.png, one line per run in every panel
    Runs ── spike_stats / validation_stats ──> DIR/summary.json, DIR/summary.md

Several runs are overlaid, labelled from their resolved configs (advantage mode, task and
sampling seeds, staleness, models). A panel whose keys no run has (an older run, a
metric turned off) is skipped, and summary.md says which.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drmas.launch.report_stats import (
    SPIKE_FACTOR,
    SPIKE_WINDOW,
    Run,
    distinct_labels,
    load_run,
    spike_stats,
    time_stats,
    validation_stats,
)


@dataclass(frozen=True)
class Panel:
    """One PNG: a figure with one axis per metric key family member."""

    name: str
    title: str
    ylabel: str
    keys: Callable[[Run], list[str]]  # the keys of this panel in a run
    log: bool = False
    validation: bool = False  # from the validation lines


def _val_keys(run: Run, what: str) -> list[str]:
    found = {k for line in run.validation for k in line if k.startswith(f"val/{what}@")}
    return sorted(k for k in found if k.count("/") == 1)


PANELS = (
    Panel("reward", "Training reward per agent", "mean reward",
          lambda r: r.keys("reward/", "/mean")),
    Panel("validation_avg", "Validation avg@k (held-out)", "avg@k",
          lambda r: _val_keys(r, "avg"), validation=True),
    Panel("validation_pass", "Validation pass@k (held-out)", "pass@k",
          lambda r: _val_keys(r, "pass"), validation=True),
    Panel("grad_norm", "Pre-clip gradient norm per model", "grad norm (log)",
          lambda r: r.keys("grad_norm/"), log=True),
    Panel("agent_grad_norm", "Gradient norm per agent", "grad norm (log)",
          lambda r: r.keys("agent_grad_norm/"), log=True),
    Panel("advantage_std", "Advantage std per agent", "std",
          lambda r: r.keys("advantage/", "/std")),
    Panel("staleness", "Staleness of trained data", "versions behind",
          lambda r: [k for k in ("staleness/mean",) if r.keys(k)]),
    Panel("throughput", "Episodes per second", "episodes/s",
          lambda r: [k for k in ("episodes_per_s",) if r.keys(k)]),
    Panel("learner_time", "Learner seconds per step: training, waiting, publishing", "s",
          lambda r: r.keys("train_s/") + r.keys("batch_wait_s/") + r.keys("weight_sync_s/")),
    Panel("process_time", "Share of each step: actors generating / waiting / loading, broker CPU",
          "fraction", lambda r: r.keys("actors/") + r.keys("broker/busy")),
)  # fmt: skip


def write_report(run_dirs: list[str | Path], out: str | Path) -> dict[str, Any]:
    """Write the PNGs and summaries; returns what was drawn: panel -> {"file", "title",
    "axes": [{"title", "xlabel", "ylabel", "lines"}]}, plus "skipped" panels."""
    runs = [load_run(d) for d in run_dirs]
    distinct_labels(runs)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, Any] = {}
    skipped: list[str] = []
    for panel in PANELS:
        keys = sorted({k for run in runs for k in panel.keys(run)})
        if not keys:
            skipped.append(panel.name)
            continue
        drawn[panel.name] = _draw(panel, keys, runs, folder / f"{panel.name}.png")
    summary = {
        "runs": [{"path": str(r.path), "label": r.label} for r in runs],
        "spikes": {r.label: spike_stats(r) for r in runs},
        "validation": {r.label: validation_stats(r) for r in runs},
        "time": {r.label: time_stats(r) for r in runs},
        "spike_rule": f"norm > {SPIKE_FACTOR:g} x median of the previous {SPIKE_WINDOW} steps",
        "skipped_panels": skipped,
        "panels": sorted(drawn),
    }
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    (folder / "summary.md").write_text(_markdown(summary))
    return drawn | {"skipped": skipped}


def _draw(panel: Panel, keys: list[str], runs: list[Run], path: Path) -> dict[str, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    described = []
    for ax, key in zip(axes.flat, keys):
        lines = 0
        for run in runs:
            xs, ys = run.series(key, run.validation if panel.validation else None)
            if panel.log:  # a zero norm (an agent without steps) has no place on a log axis
                xs, ys = [x for x, y in zip(xs, ys) if y > 0], [y for y in ys if y > 0]
            if not xs:
                continue
            ax.plot(xs, ys, marker="o" if panel.validation else None, markersize=3, label=run.label)
            if panel.validation:
                _, se = run.series(f"{key}/se", run.validation)
                if len(se) == len(ys):
                    ax.fill_between(xs, [y - s for y, s in zip(ys, se)],
                                    [y + s for y, s in zip(ys, se)], alpha=0.2)  # fmt: skip
            lines += 1
        if panel.log and lines:
            ax.set_yscale("log")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        described.append({"title": key, "xlabel": "step", "ylabel": panel.ylabel, "lines": lines})
    for ax in list(axes.flat)[len(keys) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=8)
    fig.suptitle(panel.title)
    fig.tight_layout(rect=(0, 0.08 if handles else 0, 1, 0.95))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {"file": str(path), "title": panel.title, "axes": described}


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _markdown(summary: dict[str, Any]) -> str:
    out = ["# drmas report", ""]
    out += [f"- `{r['path']}`: {r['label']}" for r in summary["runs"]]
    out += ["", f"## Gradient norms ({summary['spike_rule']})", ""]
    out += ["| run | series | steps | max | median | p95 | spikes | skipped non-finite |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, series in summary["spikes"].items():
        for name, s in series.items():
            out.append(
                f"| {label} | {name} | {s['steps']} | {_fmt(s.get('max'))} | "
                f"{_fmt(s.get('median'))} | {_fmt(s.get('p95'))} | {_fmt(s.get('spikes'))} | "
                f"{_fmt(s.get('skipped_nonfinite'))} |"
            )
    out += ["", "## Validation (± standard error over tasks)", ""]
    out += ["| run | metric | first | final | best |", "|---|---|---|---|---|"]
    for label, metrics in summary["validation"].items():
        for key, v in metrics.items():
            cells = [
                f"{_fmt(p['value'])} ± {_fmt(p['se'])} (step {p['step']})"
                for p in (v["first"], v["final"], v["best"])
            ]
            out.append(f"| {label} | {key} | {' | '.join(cells)} |")
    out += ["", "## Where the time goes", ""]
    out += ["| run | process | seconds | busy |", "|---|---|---|---|"]
    for label, t in summary["time"].items():
        for model, parts in t["learners"].items():
            spent = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in parts.items()
                              if k.endswith("_s"))  # fmt: skip
            out.append(f"| {label} | learner {model} | {spent} (of {t['span_s']:.1f}) | "
                       f"{_fmt(parts.get('busy_fraction'))} |")  # fmt: skip
        for actor, book in t["actors"].items():
            spent = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in book.items()
                              if k.endswith("_s") and k != "wall_s")  # fmt: skip
            out.append(f"| {label} | {actor} | {spent} (of {_fmt(book.get('wall_s'))}) | "
                       f"{_fmt(book.get('busy_fraction'))} |")  # fmt: skip
        broker = t.get("broker")
        if broker:
            out.append(f"| {label} | broker | cpu {broker['cpu_s']:.1f} (of {broker['wall_s']:.1f}) | "
                       f"{_fmt(broker['busy_fraction'])} |")  # fmt: skip
    brokers = {label: t["broker"] for label, t in summary["time"].items() if t.get("broker")}
    if brokers:
        out += ["", "## Broker CPU per message type", ""]
        out += ["| run | message | count | CPU s | µs each |", "|---|---|---|---|---|"]
        for label, broker in brokers.items():
            for kind, k in broker["by_kind"].items():
                out.append(f"| {label} | {kind} | {k['count']} | {k['cpu_s']:.2f} | "
                           f"{k['us_each']:.0f} |")  # fmt: skip
    if summary["skipped_panels"]:
        out += ["", "Skipped panels (no run has their metrics): "
                + ", ".join(summary["skipped_panels"]) + "."]  # fmt: skip
    return "\n".join(out) + "\n"
