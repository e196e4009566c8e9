"""The default `drmas train` against the same run with the old CPU thread settings.

    python benchmarks/perf/bench_default_speed.py [--reps 1] [--cache DIR] [--out benchmarks/results/default_speed.json]

Until this change every learner rank ran torch's default thread count (all of the
machine's cores) while the actor ran 1: on 2 cores the two learners of the default team
spun 2 OpenMP threads each beside the actor, and a learner step that takes 0.8 s alone
took about 5 s. `drmas train` now shares the CPUs among the learner ranks and actors it
starts (`learner.threads`, DRMAS_TORCH_THREADS). The baseline reproduces the old setting
exactly (DRMAS_TORCH_THREADS=1 for the actor, learner.threads = every core); both run the
embedded default in alternation, `--reps` times each, on the same model cache, so the
ratio is measured in one invocation. Reported per run: wall time, held-out avg@2 at the
first and last validation, the learners' summed train_s and batch wait, the actor's
busy fraction. Speed-up = median baseline wall / median default wall.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.perf.bench_train import run_train  # noqa: E402


def brief(result: dict) -> dict:
    val = result["validation"]
    return {
        "command": result["command"],
        "exit_code": result["exit_code"],
        "wall_s": result["wall_s"],
        "peak_rss_gb": result["peak_rss_gb"],
        "val_avg@2": [(v["step"], v["val/avg@2"], v["val/avg@2/se"]) for v in val],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "drmas"))
    parser.add_argument("--out", default="benchmarks/results/default_speed.json")
    args, overrides = parser.parse_known_args()
    cores = len(os.sched_getaffinity(0))
    old = {"env": {"DRMAS_TORCH_THREADS": "1"}, "overrides": [f"learner.threads={cores}"]}
    runs: dict[str, list[dict]] = {"baseline": [], "default": []}
    for _ in range(args.reps):
        for name, setting in (("baseline", old), ("default", {"env": {}, "overrides": []})):
            result = run_train([*setting["overrides"], *overrides], args.cache, setting["env"])
            runs[name].append(brief(result))
            print(name, json.dumps(runs[name][-1]), flush=True)
    walls = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    out = {
        "what": "the embedded default drmas train, old thread settings vs the thread plan",
        "cpus": cores,
        "baseline": "DRMAS_TORCH_THREADS=1 (actor) and learner.threads=<every core>",
        "median_wall_s": walls,
        "speedup": walls["baseline"] / walls["default"],
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("median_wall_s", "speedup")}, indent=2))


if __name__ == "__main__":
    main()
