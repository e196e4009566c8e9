"""What a new user sees from `drmas train`: the embedded default, run fresh (a new model
cache each time, so the build and warm start are part of it) once per seed.

    python benchmarks/studies/bench_default_seeds.py [--seeds 0 1 2 3] [--out benchmarks/results/default_train_seeds.json]
    python benchmarks/studies/bench_default_seeds.py --summarize       the summary from the recorded runs

Seed 0 is the plain `drmas train` of README's first command; seed s > 0 changes
everything random at once (both models' warm starts, the task order, the sampling), the
way a run on another machine starts from another warm start. Each seed's held-out avg@2
at every validation (steps 0, 15 and 30), wall time and peak memory go into --out as it
finishes (a seed already there is skipped, so a stopped run goes on where it was), with
the range and the mean's 95 % t-interval over the seeds run: the figures README states.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.perf.bench_train import run_train  # noqa: E402
from benchmarks.provenance import git_state  # noqa: E402
from benchmarks.studies.study_stats import mean_ci  # noqa: E402

METRIC = "val/avg@2"


def seed_overrides(seed: int) -> list[str]:
    """Nothing for seed 0 (the README command); else every seed the default run takes."""
    if seed == 0:
        return []
    return [
        f"models.solver.warmstart.seed={seed}",
        f"models.verifier.warmstart.seed={seed}",
        f"task.order_seed={seed}",
        f"actor.engine.seed={seed}",
    ]


def summarize(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per validation step: the range and the mean with its 95 % t-interval over seeds."""
    steps = sorted({v["step"] for r in runs.values() for v in r["validation"]})
    out: dict[str, Any] = {"seeds": sorted(int(s) for s in runs), "metric": METRIC}
    for step in steps:
        values = [v[METRIC] for r in runs.values() for v in r["validation"] if v["step"] == step]
        out[f"step {step}"] = {"min": min(values), "max": max(values), **mean_ci(values)}
    first, last = steps[0], steps[-1]
    gains = [
        next(v[METRIC] for v in r["validation"] if v["step"] == last)
        - next(v[METRIC] for v in r["validation"] if v["step"] == first)
        for r in runs.values()
    ]  # fmt: skip
    out[f"gain, step {first} to {last} (paired by seed)"] = {
        "min": min(gains),
        "max": max(gains),
        **mean_ci(gains),
    }
    out["wall_s"] = {
        "min": min(r["wall_s"] for r in runs.values()),
        "max": max(r["wall_s"] for r in runs.values()),
    }
    out["peak_rss_gb"] = max(r["peak_rss_gb"] for r in runs.values())
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3])
    p.add_argument(
        "--out", default=str(REPO / "benchmarks" / "results" / "default_train_seeds.json")
    )
    p.add_argument("--summarize", action="store_true", help="only rewrite the summary")
    args = p.parse_args()
    out = Path(args.out)
    record: dict[str, Any] = json.loads(out.read_text()) if out.is_file() else {"runs": {}}
    if args.summarize:
        record["summary"] = summarize(record["runs"])
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record["summary"], indent=2))
        return 0
    for seed in args.seeds:
        if str(seed) in record["runs"]:
            continue
        result = run_train(seed_overrides(seed))  # a fresh cache: build and warm start included
        result.pop("output")
        if result["exit_code"] != 0:
            print(f"seed {seed}: drmas train exited {result['exit_code']}", file=sys.stderr)
            return 1
        keep = ("command", "wall_s", "peak_rss_gb", "steps", "validation")
        record["runs"][str(seed)] = {**{k: result[k] for k in keep}, **git_state()}
        record["summary"] = summarize(record["runs"])
        out.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps({f"seed {seed}": [v[METRIC] for v in result["validation"]]}), flush=True)
    print(json.dumps(record.get("summary", {}), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
