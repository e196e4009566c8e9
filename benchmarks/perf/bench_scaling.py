"""Episodes/s with 1, 2 and 4 `sim` actors against one learner per model.

    python benchmarks/perf/bench_scaling.py [--actors 1 2 4] [--cache DIR] [--out benchmarks/results/scaling.json]

Each size is a full `drmas train` (broker, one gloo learner per model, N actor processes)
with the `sim` engine. The sim engines are made the bottleneck on purpose, as GPUs are
in a real deployment: a decode step sleeps `sim_token_latency_s` (50 ms) and serves at
most `max_batch` (4) sequences, one group per actor (`max_groups` 1), so one actor's
capacity is fixed and more actors add capacity; the learners train the ~1 M-parameter
builtin model on CPU. A batch is B = 8 groups and admission control lets (η + 1) · B = 16
be in flight: with η = 1 the groups of batch k + 2 wait for the weights of step k, so a
batch must hold more groups than there are actors, or a group's latency (not the actors'
capacity) sets the pace – with B = 4 and 64-token calls this benchmark measured 1.8x at 4
actors with the learners half idle.

Measured: training episodes consumed per second in steady state, from the run's
metrics.jsonl: (last step - first step) × B × G / (time of last step line - time of first
step line). The first step is excluded (it contains process start-up). Reported with its
ratio to the 1-actor run of the same invocation, and each learner's busy fraction
((train_s + weight_sync_s) / wall seconds per step): once it nears 1 the learner is the
bottleneck and adding actors stops helping (on 2 cores the learners also share the CPU
with every actor process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP_SIZE, BATCH_GROUPS, STEPS = 4, 8, 5
SETTINGS = [
    f"train.steps={STEPS}",
    f"group_size={GROUP_SIZE}",
    f"batch_groups={BATCH_GROUPS}",
    "val.every=0",
    "algorithm.max_staleness=1",
    "sampling.max_new_tokens=32",
    "actor.max_groups=1",
    "actor.engine.name=sim",
    "actor.engine.max_batch=4",
    "actor.engine.sim_token_latency_s=0.05",
    "models.solver.warmstart.steps=60",
    "models.verifier.warmstart.steps=60",
    "train.progress=false",
]


def run(actors: int, cache: str, work: Path) -> dict:
    run_dir = work / f"actors-{actors}"
    cmd = [sys.executable, "-m", "drmas.launch.cli", "train", *SETTINGS,
           f"actor.num_actors={actors}", f"run.dir={run_dir}", f"run.cache_dir={cache}"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{actors} actors: drmas train failed:\n{proc.stdout[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    steps = sorted((x["step"], x["time_s"]) for x in lines if "val/tasks" not in x)
    (first, t0), (last, t1) = steps[0], steps[-1]
    summary = json.loads((run_dir / "broker_summary.json").read_text())
    steady = [x for x in lines if "val/tasks" not in x and x["step"] > first]
    step_s = (t1 - t0) / max(last - first, 1)
    learner = {}
    for model in ("solver", "verifier"):
        busy = [
            x.get(f"train_s/{model}", 0.0) + x.get(f"weight_sync_s/{model}", 0.0) for x in steady
        ]
        learner[model] = sum(busy) / max(len(busy), 1) / step_s  # fraction of each step
    return {
        "actors": actors,
        "episodes_per_s": (last - first) * GROUP_SIZE * BATCH_GROUPS / (t1 - t0),
        "steady_steps": last - first,
        "steady_s": t1 - t0,
        "wall_s": wall,
        "actors_joined": summary["counters"]["actors_joined"],
        "dropped_stale_groups": summary["counters"].get("dropped_stale_groups", 0),
        "weight_digest_match": summary["counters"].get("weight_digest_match", 0),
        "step_s": step_s,
        # training + publishing time per step / wall time per step: near 1 = the learner is
        # the bottleneck and more actors cannot help
        "learner_busy": learner,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--cache", default="", help="builtin model cache (default: a fresh one)")
    parser.add_argument("--out", default="benchmarks/results/scaling.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="drmas-scaling-"))
    cache = args.cache or str(work / "cache")
    runs = []
    for n in args.actors:
        runs.append(run(n, cache, work))
        print(json.dumps(runs[-1]), flush=True)
    base = runs[0]["episodes_per_s"]
    for r in runs:
        r["ratio_to_first"] = r["episodes_per_s"] / base
    result = {
        "what": "steady-state training episodes/s, sim actors as the bottleneck",
        "settings": SETTINGS,
        "cpus": os.cpu_count(),
        "baseline_actors": runs[0]["actors"],
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
