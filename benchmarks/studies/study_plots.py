"""The advantage-mode study's figures (benchmarks/studies/study_advantage_modes.py --plots DIR).

    <out>/<name>.json + <out>/run_files/<name>/metrics.jsonl
      ── plots ──> results_paired.png (each seed's final avg@k, agent against global, per
                   group with at least 2 paired seeds) and results_<group>_grad_norm.png
                   (each model's pre-clip gradient norm over steps, one line per run)

matplotlib only here, so the summary and its tests never import it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

COLORS = {"agent": "tab:blue", "global": "tab:orange"}


def training_lines(out: Path, name: str) -> list[dict[str, Any]]:
    """The training lines of a study run (from its kept metrics.jsonl; none if missing)."""
    path = out / "run_files" / name / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if "val/tasks" not in x]


def plots(out: Path, folder: Path) -> list[Path]:
    """Write the figures into `folder`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))
               if p.name != "study_summary.json"]  # fmt: skip

    def paired_seeds(group: str) -> int:
        modes = [{r["seed"] for r in results if r["group"] == group and r["mode"] == m}
                 for m in ("agent", "global")]  # fmt: skip
        return len(modes[0] & modes[1])

    groups = sorted({r["group"] for r in results if paired_seeds(r["group"]) >= 2})
    written = [_paired_figure(plt, results, groups, folder)]
    for group in groups:
        written.append(_grad_figure(plt, out, [r for r in results if r["group"] == group
                                               and r["mode"] in COLORS], group, folder))  # fmt: skip
    return written


def _paired_figure(plt: Any, results: list[dict], groups: list[str], folder: Path) -> Path:
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        by = {(r["mode"], r["seed"]): r for r in results if r["group"] == group}
        key = next(k for k in by[next(iter(by))]["final"] if k.startswith("val/avg@"))
        seeds = sorted(s for m, s in by if m == "agent" and ("global", s) in by)
        for s in seeds:
            a, g = by[("agent", s)]["final"][key], by[("global", s)]["final"][key]
            ax.plot([0, 1], [g, a], color="grey", lw=1)
            ax.scatter([0], [g], color=COLORS["global"], zorder=3)
            ax.scatter([1], [a], color=COLORS["agent"], zorder=3)
        ax.set_xticks([0, 1], ["GRPO (global)", "Dr. MAS (agent)"])
        ax.set_xlim(-0.4, 1.4)
        ax.set_title(f"{group}: final {key[4:]} per seed")
        ax.set_ylabel(f"held-out {key[4:]}")
    fig.tight_layout()
    path = folder / "results_paired.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _grad_figure(plt: Any, out: Path, runs: list[dict], group: str, folder: Path) -> Path:
    lines = {r["name"]: training_lines(out, r["name"]) for r in runs}
    models = sorted({k.split("/", 1)[1] for ls in lines.values() for x in ls for k in x
                     if k.startswith("grad_norm/")})  # fmt: skip
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for r in runs:
            xs = [x["step"] for x in lines[r["name"]] if f"grad_norm/{model}" in x]
            ys = [x[f"grad_norm/{model}"] for x in lines[r["name"]] if f"grad_norm/{model}" in x]
            ax.plot(xs, ys, color=COLORS[r["mode"]], lw=1, alpha=0.7)
        ax.set_yscale("log")
        ax.set_title(f"grad_norm/{model}")
        ax.set_xlabel("step")
        ax.set_ylabel("pre-clip grad norm (log)")
    handles = [
        plt.Line2D([], [], color=c, label=f"{m} ({len({r['seed'] for r in runs if r['mode'] == m})} seeds)")
        for m, c in COLORS.items()
    ]  # fmt: skip
    fig.legend(handles=handles, loc="lower center", ncol=2)
    fig.suptitle(f"{group}: gradient norm per model, Dr. MAS (agent) and GRPO (global)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = folder / f"results_{group}_grad_norm.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
