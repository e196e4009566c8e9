"""Asynchronous against synchronous training on the same work: `algorithm.max_staleness`
η = 0 (on-policy: an actor generates only with the newest weights, so generation and
training take turns) against η = 1 and 2 (generation of the next batches overlaps
training).

    python benchmarks/perf/bench_async.py [--steps 6] [--out benchmarks/results/async.json]
    python benchmarks/perf/bench_async.py --balanced-reps 3 --latency 0.0172   # the spread of (a)

Every run is a full `drmas train` of the default math team (broker, one gloo learner per
model, N actor processes on loopback) for the same number of steps, so the same number of
trained episodes (steps × B × G) on the same tasks with the same learners. Parts:

(a) `sim` engine, 1 actor, η = 0, 1, 2, with generation made as costly as training: a
    calibration run at η = 0 measures a learner step (`train_s`) and the actor's
    generating time per step at a trial `sim_token_latency_s`, and the sweep uses the
    latency that makes them equal (stated in the result). Sim actors sleep instead of
    computing, so generation and training do not compete for the 2 cores here: this is
    the overlap a deployment gets when actors and learners have their own devices.
(b) the real `hf` engine, 1 actor, η = 0, 1, 2: generation and training compete for the
    same 2 cores, so overlap can only win what one side leaves idle.
(c) the sim sweep of (a) with 2 and 4 actors (η = 0, 1, 2).

Per run: wall seconds (`drmas train` start to exit), steady-state episodes/s (steps after
the first), each learner's busy fraction ((train_s + weight_sync_s) per step / seconds per
step), the actors' busy fraction (generating / wall, from RUN_DIR/logs/*.time.json), mean
staleness, dropped stale groups, and the ratio of episodes/s to η = 0 of the same engine
and actor count. The limit for two overlapped stages of equal cost is 2×.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUP_SIZE, BATCH_GROUPS = 4, 8
COMMON = [
    f"group_size={GROUP_SIZE}",
    f"batch_groups={BATCH_GROUPS}",
    "val.every=0",
    "val.at_start=false",
    "sampling.max_new_tokens=24",
    "models.solver.warmstart.steps=60",
    "models.verifier.warmstart.steps=60",
    "train.progress=false",
]
SIM = ["actor.engine.name=sim", "actor.engine.max_batch=64", "actor.engine.sim_stop_prob=0.05"]


def run(name: str, work: Path, cache: str, steps: int, *extra: str) -> dict:
    run_dir = work / name
    cmd = [sys.executable, "-m", "drmas.launch.cli", "train", *COMMON, f"train.steps={steps}",
           *extra, f"run.dir={run_dir}", f"run.cache_dir={cache}"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: drmas train failed:\n{proc.stdout[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = sorted((x for x in lines if "val/tasks" not in x), key=lambda x: x["step"])
    first, last = train[0], train[-1]
    steady = train[1:]
    span = last["time_s"] - first["time_s"]
    step_s = span / max(last["step"] - first["step"], 1)
    learner = {
        m: statistics.mean(x.get(f"train_s/{m}", 0.0) + x.get(f"weight_sync_s/{m}", 0.0)
                           for x in steady) / step_s
        for m in ("solver", "verifier")
    }  # fmt: skip
    train_s = statistics.mean(max(x["train_s/solver"], x["train_s/verifier"]) for x in steady)
    books = [json.loads(f.read_text()) for f in sorted((run_dir / "logs").glob("*.time.json"))]
    summary = json.loads((run_dir / "broker_summary.json").read_text())
    return {
        "run": name,
        "wall_s": wall,
        "steps": last["step"],
        "episodes": last["step"] * GROUP_SIZE * BATCH_GROUPS,
        "episodes_per_s": (last["step"] - first["step"]) * GROUP_SIZE * BATCH_GROUPS / span,
        "step_s": step_s,
        "train_s_per_step": train_s,
        "generating_s_per_step": statistics.mean(b["generating_s"] for b in books) / last["step"],
        "learner_busy": learner,
        "actor_busy": statistics.mean(b["busy_fraction"] for b in books) if books else None,
        "actors": len(books),
        "staleness_mean": statistics.mean(x.get("staleness/mean", 0.0) for x in steady),
        "dropped_stale_groups": summary["counters"].get("dropped_stale_groups", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--trial-latency", type=float, default=0.02)
    parser.add_argument("--cache", default="", help="builtin model cache (default: a fresh one)")
    parser.add_argument("--out", default="benchmarks/results/async.json")
    parser.add_argument("--balanced-reps", type=int, default=0,
                        help="only repeat the balanced sim pair (1 actor, η = 0, 1, 2) this many "
                        "times at --latency, to see the run-to-run spread")  # fmt: skip
    parser.add_argument(
        "--latency", type=float, default=0.0, help="sim_token_latency_s of the reps"
    )
    args = parser.parse_args()
    if args.balanced_reps:
        balanced_reps(args)
        return
    work = Path(tempfile.mkdtemp(prefix="drmas-async-"))
    cache = args.cache or str(work / "cache")
    runs: list[dict] = []

    def do(name: str, *extra: str) -> dict:
        r = run(name, work, cache, args.steps, *extra)
        print(json.dumps(r), flush=True)
        runs.append(r)
        return r

    # calibration: learner step vs generation at a trial latency (sync, so they take turns)
    trial = do("calibrate", *SIM, f"actor.engine.sim_token_latency_s={args.trial_latency}",
               "algorithm.max_staleness=0")  # fmt: skip
    latency = args.trial_latency * trial["train_s_per_step"] / trial["generating_s_per_step"]
    sim = [*SIM, f"actor.engine.sim_token_latency_s={latency:.4f}"]
    for actors in (1, 2, 4):
        for eta in (0, 1, 2):
            do(f"sim-a{actors}-eta{eta}", *sim, f"actor.num_actors={actors}",
               f"algorithm.max_staleness={eta}")  # fmt: skip
    for eta in (0, 1, 2):
        do(f"hf-a1-eta{eta}", f"algorithm.max_staleness={eta}")

    by_name = {r["run"]: r for r in runs}
    for r in runs:
        if r["run"] == "calibrate":
            continue
        base = by_name[r["run"].rsplit("-eta", 1)[0] + "-eta0"]
        r["ratio_to_eta0"] = r["episodes_per_s"] / base["episodes_per_s"]
    result = {
        "what": "steady-state training episodes/s at max_staleness 0 (sync) vs 1, 2 (async), "
        "same team, tasks, learners and number of trained episodes",
        "calibration": {
            "trial_latency_s": args.trial_latency,
            "train_s_per_step": trial["train_s_per_step"],
            "generating_s_per_step_at_trial": trial["generating_s_per_step"],
            "sim_token_latency_s": latency,
        },
        "settings": [*COMMON, f"train.steps={args.steps}"],
        "cpus": os.cpu_count(),
        "goal": "sim, 1 actor, balanced: >= 1.8x at eta >= 1",
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in runs[1:]:
        print(f"{r['run']:>14}: {r['episodes_per_s']:6.2f} ep/s  x{r['ratio_to_eta0']:.2f}  "
              f"learners {r['learner_busy']}  actors {r['actor_busy']:.2f}  "
              f"stale {r['staleness_mean']:.2f}")  # fmt: skip


def balanced_reps(args: argparse.Namespace) -> None:
    """The balanced sim runs again, η = 0, 1, 2 in turn, `args.balanced_reps` times: the
    ratio of each rep's η = 1 and 2 to its own η = 0, and their spread."""
    if args.latency <= 0:
        raise SystemExit("--balanced-reps needs --latency (the calibrated sim_token_latency_s)")
    work = Path(tempfile.mkdtemp(prefix="drmas-async-reps-"))
    cache = args.cache or str(work / "cache")
    sim = [*SIM, f"actor.engine.sim_token_latency_s={args.latency}"]
    reps = []
    for rep in range(args.balanced_reps):
        runs = {eta: run(f"rep{rep}-eta{eta}", work, cache, args.steps, *sim,
                         f"algorithm.max_staleness={eta}") for eta in (0, 1, 2)}  # fmt: skip
        base = runs[0]["episodes_per_s"]
        reps.append({
            "episodes_per_s": {eta: r["episodes_per_s"] for eta, r in runs.items()},
            "ratio": {eta: r["episodes_per_s"] / base for eta, r in runs.items() if eta},
            "train_s_per_step": {eta: r["train_s_per_step"] for eta, r in runs.items()},
        })  # fmt: skip
        print(json.dumps(reps[-1]), flush=True)
    result = {
        "what": "sim, 1 actor, balanced load: eta 1 and 2 against eta 0, repeated",
        "sim_token_latency_s": args.latency,
        "settings": [*COMMON, f"train.steps={args.steps}"],
        "reps": reps,
        "ratio_mean": {eta: statistics.mean(r["ratio"][eta] for r in reps) for eta in (1, 2)},
        "ratio_min": {eta: min(r["ratio"][eta] for r in reps) for eta in (1, 2)},
        "ratio_max": {eta: max(r["ratio"][eta] for r in reps) for eta in (1, 2)},
    }
    out = Path(args.out).with_name("async_balanced_reps.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("ratio_mean", "ratio_min", "ratio_max")}))


if __name__ == "__main__":
    main()
