"""`algorithm.skip_zero_variance` on the default team: learner steps to reach plain Dr. MAS's
final held-out avg@k, over seeds.

    python benchmarks/studies/bench_skip_zero_variance.py [--seeds 0 1 2] [--out benchmarks/results/skip_zero_variance.json]
    python benchmarks/studies/bench_skip_zero_variance.py --summarize   # only recompute from the recorded runs

Per seed, two `drmas train` runs of the default team (Solver and Verifier, Dr. MAS), one
plain and one with `algorithm.skip_zero_variance=true`, identical otherwise. The seed
varies the warm starts of both models, the task stream and the sampling. Both are
on-policy (`algorithm.max_staleness=0`), so how busy the machine is cannot change what
they learn; validation every 5 steps (held-out split, n = k = 4) gives the curve.

Per seed: plain's final avg@k (the mean of its last two validations, steps 25 and 30), the
first validated step at which the skipping run reaches it (or "not reached"), the final
avg@k difference, and what skipping cost: groups generated per trained group and the
share of generated groups it left out. Over seeds: mean and 95 % t-interval of the paired
differences (benchmarks/studies/study_stats.py). Results: one JSON per run beside the summary.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.studies.study_stats import mean_ci, significant  # noqa: E402
from benchmarks.studies.variant_runs import run_variants  # noqa: E402
from drmas.launch.report_stats import load_run  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "skip_zero_variance.json"
STEPS = 30
K = 4
METRIC = f"val/avg@{K}"
COMMON = (
    "algorithm.max_staleness=0",
    f"train.steps={STEPS}",
    "val.every=5",
    "val.at_start=true",
    f"val.n={K}",
    f"val.k={K}",
    "train.progress=false",
)
VARIANTS = {"plain": (), "skip": ("algorithm.skip_zero_variance=true",)}


def overrides(variant: str, seed: int, run_dir: Path) -> list[str]:
    return [
        *COMMON,
        *VARIANTS[variant],
        f"task.order_seed={seed}",
        f"actor.engine.seed={seed}",
        f"models.solver.warmstart.seed={seed}",
        f"models.verifier.warmstart.seed={seed}",
        f"run.dir={run_dir}",
    ]


def measure(run_dir: Path) -> dict[str, Any]:
    """The validation curve and what the broker counted: groups taken in and skipped."""
    run = load_run(run_dir)
    summary = json.loads((run_dir / "broker_summary.json").read_text())
    return {
        "curve": [[int(v["step"]), v[METRIC]] for v in run.validation if METRIC in v],
        "counters": {k: summary["counters"].get(k, 0) for k in
                     ("groups_accepted", "zero_variance_groups_skipped")},
        "trained_groups": summary.get("trained_groups", {}),
    }  # fmt: skip


def final(record: dict[str, Any]) -> float:
    """The mean of the last two validations (one round is noisy at n = k = 4)."""
    last = [v for _, v in record["curve"][-2:]]
    return sum(last) / len(last)


def steps_to_reach(record: dict[str, Any], target: float) -> int | None:
    return next((step for step, v in record["curve"] if step > 0 and v >= target), None)


def cost(record: dict[str, Any]) -> dict[str, float]:
    generated = record["counters"]["groups_accepted"]
    trained = max(record["trained_groups"].values(), default=0)
    skipped = record["counters"]["zero_variance_groups_skipped"]
    return {
        "groups_per_trained_group": generated / trained if trained else float("nan"),
        "skipped_share": skipped / generated if generated else 0.0,
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["variant"], r["seed"]): r for r in records}
    seeds = sorted(s for v, s in by if v == "plain" and ("skip", s) in by)
    per_seed = {}
    for s in seeds:
        plain, skip = by[("plain", s)], by[("skip", s)]
        target = final(plain)
        per_seed[str(s)] = {
            "plain_final": target, "skip_final": final(skip),
            "plain_steps_to_its_final": steps_to_reach(plain, target),
            "skip_steps_to_plain_final": steps_to_reach(skip, target),
            "plain_cost": cost(plain), "skip_cost": cost(skip),
        }  # fmt: skip
    diffs = [p["skip_final"] - p["plain_final"] for p in per_seed.values()]
    reached = [p["skip_steps_to_plain_final"] for p in per_seed.values()]
    plain_reached = [p["plain_steps_to_its_final"] for p in per_seed.values()]
    return {
        "metric": METRIC, "steps": STEPS, "setup": list(COMMON), "seeds": seeds,
        "per_seed": per_seed,
        "final_difference_skip_minus_plain": significant(mean_ci(diffs)),
        "skip_steps_to_plain_final": reached,
        "plain_steps_to_its_own_final": plain_reached,
        "skip_groups_per_trained_group": mean_ci(
            [p["skip_cost"]["groups_per_trained_group"] for p in per_seed.values()]),
        "skip_skipped_share": mean_ci([p["skip_cost"]["skipped_share"] for p in per_seed.values()]),
    }  # fmt: skip


def main() -> None:
    out, records = run_variants(__doc__.split("\n\n")[0], OUT, VARIANTS, overrides, measure)
    summary = summarize(records)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in summary if k != "per_seed"}, indent=2))


if __name__ == "__main__":
    main()
