"""From the study's recorded runs to its numbers (study_summary.json).

    <out>/<name>.json (one per finished run: final validation, gradient statistics,
    provenance) + <out>/run_files/<name>/metrics.jsonl (steps per agent, times)
      ── summarize ──> per group: each mode's mean and 95 % t-interval over seeds,
         step 0, paired differences (with their % of the baseline), gradient statistics
         and sign tests, invalid actions, steps per batch, and the commits the runs used

benchmarks/studies/study_tables.py turns this into the tables of docs/results.md. Pure Python
over plain dicts (statistics in benchmarks/studies/study_stats.py), no drmas import.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.studies.study_stats import (  # noqa: E402
    mean_ci,
    ratio_ci,
    relative,
    seeds_needed,
    sign_test,
    significant,
)

Result = dict[str, Any]


def load_results(out: Path) -> list[Result]:
    """Every finished run's JSON in the results folder (not the summary itself)."""
    return [
        json.loads(p.read_text())
        for p in sorted(out.glob("*.json"))
        if p.name != "study_summary.json"
    ]


def metric_keys(results: list[Result]) -> list[str]:
    """val/avg@k and val/pass@k (not pass@1, not the per-source keys), sorted."""
    return sorted(
        {
            k
            for r in results
            for k in r["final"]
            if k.startswith(("val/avg@", "val/pass@")) and k.count("/") == 1 and k != "val/pass@1"
        }
    )


def summarize(
    results: list[Result], references: dict[str, str], steps: dict[str, list[dict]]
) -> dict[str, Any]:
    """The whole study: `references` maps a group to the group whose agent and global
    runs it is paired with (the ablations and the async pair with math); `steps` maps a
    run's name to its metrics lines (run_files/<name>/metrics.jsonl; none if missing)."""
    groups: dict[str, Any] = {}
    for group in sorted({r["group"] for r in results}):
        mine = [r for r in results if r["group"] == group]
        ref = [r for r in results if group in references and r["group"] == references[group]]
        groups[group] = summarize_group(mine, ref, metric_keys(mine), steps)
        groups[group]["reference"] = references.get(group)
    return {"groups": groups}


def summarize_group(
    mine: list[Result], ref: list[Result], keys: list[str], steps: dict[str, list[dict]]
) -> dict[str, Any]:
    """One group; `ref` holds the runs of its reference group (empty if it has none)."""
    by = {(r["mode"], r["seed"]): r for r in mine}
    ref_by = {(r["mode"], r["seed"]): r for r in ref}
    modes = {}
    for mode in sorted({r["mode"] for r in mine}):
        rs = sorted((r for r in mine if r["mode"] == mode), key=lambda r: r["seed"])
        modes[mode] = {
            "seeds": [r["seed"] for r in rs],
            "per_seed": {str(r["seed"]): _final(r, keys) for r in rs},
            **{k: mean_ci([r["final"][k] for r in rs if k in r["final"]]) for k in keys},
            "wall_s": mean_ci([r["wall_s"] for r in rs]),
            "grad": _grad(rs),
        }
    step0 = {
        str(r["seed"]): r["validation"][0]
        for r in mine
        if r["validation"] and r["validation"][0]["step"] == 0
    }
    paired = [_pair(by, "agent", "global", by, keys)] if {"agent", "global"} <= _modes(by) else []
    if ref:
        paired += [
            _pair(by, mode, base, ref_by, keys)
            for mode in modes
            for base in ("agent", "global")
            if mode not in ("agent", "global") and base in _modes(ref_by)
        ]
    return {
        "modes": modes,
        "step0": step0,
        "step0_mean": {k: mean_ci([v[k] for v in step0.values() if k in v]) for k in keys},
        "paired": [p for p in paired if p["seeds"]],
        "reference_means": _reference_means(by, ref_by, keys) if ref else {},
        "spikes_agent_vs_global": _spike_signs(by),
        "steps_per_batch": _steps_per_batch([steps.get(r["name"], []) for r in mine]),
        "provenance": _provenance(mine, steps),
    }


def _modes(by: dict) -> set[str]:
    return {m for m, _ in by}


def _final(r: Result, keys: list[str]) -> dict[str, float]:
    extra = ("val/invalid_actions",)
    return {k: r["final"][k] for k in (*keys, *extra) if k in r["final"]}


def _pair(by: dict, mode: str, base: str, base_by: dict, keys: list[str]) -> dict[str, Any]:
    """mode - base, paired by seed over the seeds both have; each metric's interval, its
    % of the baseline's mean over those seeds and, for the main pair, how many seeds an
    interval this wide would need to exclude 0 at this mean."""
    seeds = sorted(s for m, s in by if m == mode and (base, s) in base_by)
    metrics = {}
    for k in keys:
        a = [by[(mode, s)]["final"][k] for s in seeds]
        b = [base_by[(base, s)]["final"][k] for s in seeds]
        ci = significant(mean_ci([x - y for x, y in zip(a, b)]))
        base_mean = statistics.fmean(b) if b else 0.0
        ci["base_mean"] = base_mean
        ci["relative_pct"] = relative(ci, base_mean) if base_mean else None
        ci["seeds_needed"] = seeds_needed(ci["mean"], ci["sd"]) if ci["sd"] else None
        ci["per_seed"] = {str(s): [x, y] for s, x, y in zip(seeds, a, b)}
        metrics[k] = ci
    grad = {}
    for model in _models([by[(mode, s)] for s in seeds]):
        pairs = [
            (by[(mode, s)]["spikes"][f"model {model}"]["max"],
             base_by[(base, s)]["spikes"][f"model {model}"]["max"])
            for s in seeds
            if f"model {model}" in by[(mode, s)]["spikes"]
            and f"model {model}" in base_by[(base, s)]["spikes"]
        ]  # fmt: skip
        pairs = [p for p in pairs if p[0] > 0 and p[1] > 0]  # a model that never got a gradient
        if pairs:
            grad[model] = ratio_ci([p[0] for p in pairs], [p[1] for p in pairs])
    return {"mode": mode, "base": base, "seeds": seeds, "metrics": metrics, "max_grad_ratio": grad}


def _models(rs: list[Result]) -> list[str]:
    return sorted({u[6:] for r in rs for u in r["spikes"] if u.startswith("model ")})


def _grad(rs: list[Result]) -> dict[str, Any]:
    """Per model, over the seeds of one mode: the mean of each run's largest and median
    pre-clip gradient norm, each seed's largest, total spike steps (> 3x the median of
    the 10 before) and steps skipped for a non-finite norm."""
    out = {}
    for model in _models(rs):
        st = [r["spikes"][f"model {model}"] for r in rs if f"model {model}" in r["spikes"]]
        out[model] = {
            "max": statistics.fmean(s["max"] for s in st),
            "median": statistics.fmean(s["median"] for s in st),
            "max_per_seed": [s["max"] for s in st],
            "max_over_median_per_seed": [s["max"] / s["median"] for s in st if s["median"]],
            "spikes": sum(s["spikes"] for s in st),
            "spikes_per_seed": [s["spikes"] for s in st],
            "skipped_nonfinite": sum(s.get("skipped_nonfinite") or 0 for s in st),
        }
    return out


def _spike_signs(by: dict) -> dict[str, Any]:
    """Per model and in all: spike steps agent vs global, seed by seed (a sign test)."""
    seeds = sorted(s for m, s in by if m == "agent" and ("global", s) in by)
    if not seeds:
        return {}

    def count(mode: str, s: int, model: str | None) -> int:
        units = by[(mode, s)]["spikes"]
        return sum(
            v["spikes"]
            for u, v in units.items()
            if u.startswith("model ") and (model is None or u == f"model {model}")
        )

    out = {}
    for model in [None, *_models([by[("agent", s)] for s in seeds])]:
        a = [count("agent", s, model) for s in seeds]
        g = [count("global", s, model) for s in seeds]
        out[model or "all"] = {"agent": a, "global": g, **sign_test(a, g)}
    return out


def _steps_per_batch(runs: list[list[dict]]) -> dict[str, list[float]]:
    """Per agent, the fewest and most steps it took in one batch over every run."""
    seen: dict[str, list[float]] = {}
    for lines in runs:
        for line in lines:
            for k, v in line.items():
                if k.startswith("steps/") and k.count("/") == 1:
                    seen.setdefault(k[6:], []).append(v)
    return {agent: [min(v), max(v)] for agent, v in sorted(seen.items())}


def _reference_means(by: dict, ref_by: dict, keys: list[str]) -> dict[str, Any]:
    """The reference group's agent and global means over this group's seeds."""
    seeds = sorted({s for _, s in by})
    return {
        mode: {
            "seeds": [s for s in seeds if (mode, s) in ref_by],
            **{
                k: statistics.fmean(
                    ref_by[(mode, s)]["final"][k] for s in seeds if (mode, s) in ref_by
                )
                for k in keys
                if any((mode, s) in ref_by for s in seeds)
            },
        }
        for mode in ("agent", "global")
    }


def _provenance(rs: list[Result], steps: dict[str, list[dict]]) -> dict[str, Any]:
    """Which commits the runs used (commit + '-dirty' when the tree had changes), the
    runs that did not record one, and the span of their metrics lines (unix seconds)."""
    commits: dict[str, list[str]] = {}
    for r in rs:
        if r.get("commit"):
            tag = r["commit"][:12] + ("-dirty" if r.get("dirty") else "")
            if r.get("commit_at_end") and r["commit_at_end"] != r["commit"]:
                tag += f" (tree moved to {r['commit_at_end'][:12]} during the run)"
            commits.setdefault(tag, []).append(r["name"])
    times = [
        line["time_s"]
        for r in rs
        for line in steps.get(r["name"], [])
        if isinstance(line.get("time_s"), (int, float))
    ]
    return {
        "commits": commits,
        "not_recorded": sorted(r["name"] for r in rs if not r.get("commit")),
        "time_span_s": [min(times), max(times)] if times else None,
    }
