"""Do an agent's gradient spikes line up with its small-sample statistics? (issue #24, part 4)

    python benchmarks/studies/spike_diagnostics.py RUN_DIR [RUN_DIR ...] [--json OUT]

Reads each run's metrics.jsonl (a `drmas train` run folder) and, per agent, takes its
gradient norm per step (`agent_grad_norm/<agent>`) and the batch diagnostics the broker
logs beside it (drmas/broker/variation.py; docs/algorithm.md, "Steadier agent statistics"):
groups acting, lone, varying, penalty-only, and the largest |advantage|. A spike is what
`drmas report` calls one (a norm over 3x the median of the 10 steps before it). For each
diagnostic it prints the mean at spike steps and at the other steps, and the Spearman rank
correlation with the gradient norm over all steps (Spearman: the norms are heavy-tailed).
Pooled over the runs given, so pass the seeds of one configuration together.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from drmas.launch.report_stats import load_run, spikes  # noqa: E402

DIAGNOSTICS = ("groups_acting/{}", "groups_lone/{}", "groups_varying/{}",
               "groups_penalty_only/{}", "advantage/{}/max_abs")  # fmt: skip


def _ranks(x: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean of their ranks)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=np.float64)
    for value in np.unique(x):
        tied = x == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def spearman(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3:
        return None
    rx, ry = _ranks(np.asarray(x)), _ranks(np.asarray(y))
    if rx.std() == 0 or ry.std() == 0:
        return None
    return float(np.corrcoef(rx, ry)[0, 1])


def agent_rows(run_dirs: list[Path]) -> dict[str, list[dict[str, float]]]:
    """agent -> one row per (run, step): its norm, spike flag and diagnostics."""
    rows: dict[str, list[dict[str, float]]] = {}
    for folder in run_dirs:
        run = load_run(folder)
        for key in run.keys("agent_grad_norm/"):
            agent = key.split("/", 1)[1]
            lines = [line for line in run.steps if math.isfinite(line.get(key, math.inf))]
            norms = [float(line[key]) for line in lines]
            spiked = set(spikes(norms))
            for i, line in enumerate(lines):
                row = {"norm": norms[i], "spike": float(i in spiked), "step": line["step"]}
                for pattern in DIAGNOSTICS:
                    name = pattern.format(agent)
                    if name in line:
                        row[pattern.format("<agent>")] = float(line[name])
                rows.setdefault(agent, []).append(row)
    return rows


def summarize(rows: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for agent, table in sorted(rows.items()):
        spike = [r for r in table if r["spike"]]
        calm = [r for r in table if not r["spike"]]
        entry: dict[str, object] = {"steps": len(table), "spikes": len(spike)}
        for pattern in DIAGNOSTICS:
            key = pattern.format("<agent>")
            have = [r for r in table if key in r]
            if not have:
                continue  # a run from before the diagnostics existed
            entry[key] = {
                "mean_at_spikes": _mean([r[key] for r in spike if key in r]),
                "mean_elsewhere": _mean([r[key] for r in calm if key in r]),
                "spearman_with_norm": spearman([r[key] for r in have], [r["norm"] for r in have]),
            }
        out[agent] = entry
    return out


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="drmas train run folders")
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args = parser.parse_args()
    summary = summarize(agent_rows(args.runs))
    for agent, entry in summary.items():
        print(f"{agent}: {entry['steps']} steps, {entry['spikes']} spikes")
        for key, value in entry.items():
            if isinstance(value, dict):
                cells = ", ".join(
                    f"{k} {v:.3f}" if isinstance(v, float) else f"{k} -" for k, v in value.items()
                )
                print(f"  {key}: {cells}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
