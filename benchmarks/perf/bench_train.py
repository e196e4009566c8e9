"""A `drmas train` run on this machine: wall time, peak resident memory, learning.

    python benchmarks/perf/bench_train.py [--cache DIR] [--out benchmarks/results/default_train.json] [overrides...]
    python benchmarks/perf/bench_train.py --out benchmarks/results/search_tiny_agent.json experiment=search_tiny

Runs `drmas train` with the overrides (none: the embedded default, the README's first
command) as a child process, samples the resident memory of its whole process tree every
0.5 s, and reads the run's metrics to compare, in the first and last quarter of the
steps, each agent's training reward, the workflow's rollout metrics (rollout/em, ... for
the search team) and the validation metrics (val/avg@k, val/pass@k, val/em, ...; the
validations at steps <= 1/4 and >= 3/4 of the run).
Targets: <= 15 min wall and <= 6 GB total resident memory on 2 cores (issue #2 for the
default, issue #5 for experiment=search_tiny).
A fresh --cache includes building and warm-starting the builtin model in the time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a child that just exited
            total += p.memory_info().rss
    return total


def quarter_means(lines: list[dict], key: str) -> tuple[float, float]:
    values = [x[key] for x in lines if key in x]
    q = max(1, len(values) // 4)
    return sum(values[:q]) / q, sum(values[-q:]) / q


def run_train(overrides: list[str], cache: str = "", env: dict[str, str] | None = None) -> dict:
    """One `drmas train` with `overrides` (and extra environment `env`): its wall time,
    peak memory, validation lines and first/last-quarter means; `output` is its log tail."""
    work = Path(tempfile.mkdtemp(prefix="drmas-bench-"))
    cache = cache or str(work / "cache")
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "drmas.launch.cli", "train", f"run.dir={run_dir}",
           f"run.cache_dir={cache}", *overrides]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.5)
    wall = time.monotonic() - start
    output = proc.stdout.read() if proc.stdout else ""
    if not (run_dir / "metrics.jsonl").is_file():
        raise SystemExit(
            f"drmas train exited {proc.returncode} before any metrics:\n{output[-3000:]}"
        )
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [x for x in lines if "val/tasks" not in x]
    val = [x for x in lines if "val/tasks" in x]
    result: dict = {
        "command": " ".join(
            [*(f"{k}={v}" for k, v in (env or {}).items()), "drmas train", *overrides]
        ),
        "run_dir": str(run_dir),
        "exit_code": proc.returncode,
        "wall_s": wall,
        "peak_rss_gb": peak / 1e9,
        "steps": len(train),
        "validation": val,
        "summary": json.loads((run_dir / "broker_summary.json").read_text()),
        "output": output[-3000:],
    }
    keys = sorted(
        {k for x in train for k in x if k.startswith("reward/") and k.endswith("/mean")}
        | {k for x in train for k in x if k.startswith("rollout/")}
    )
    for key in keys:
        first, last = quarter_means(train, key)
        result[f"{key}/first_quarter"] = first
        result[f"{key}/last_quarter"] = last
    steps = max((x["step"] for x in train), default=0)
    early = [x for x in val if x["step"] <= steps / 4]
    late = [x for x in val if x["step"] >= 3 * steps / 4]
    for key in sorted({k for x in val for k in x if k.startswith("val/") and k != "val/tasks"}):
        for name, part in (("first_quarter", early), ("last_quarter", late)):
            values = [x[key] for x in part if key in x]
            if values:
                result[f"{key}/{name}"] = sum(values) / len(values)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="", help="builtin model cache (default: a fresh one)")
    parser.add_argument("--out", default="benchmarks/results/default_train.json")
    args, overrides = parser.parse_known_args()
    result = run_train(overrides, args.cache)
    output = result.pop("output")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(output)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("validation", "summary")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
