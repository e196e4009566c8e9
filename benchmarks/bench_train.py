"""The default `drmas train` on this machine: wall time, peak resident memory, learning.

    python benchmarks/bench_train.py [--cache DIR] [--out benchmarks/results/default_train.json] [overrides...]

Runs the embedded default (the README's first command) as a child process, samples the
resident memory of its whole process tree every 0.5 s, and reads the run's metrics to
compare each agent's training reward in the first and last quarter of the steps.
Targets (issue #2): <= 15 min wall and <= 6 GB total resident memory on 2 cores.
A fresh --cache includes building and warm-starting the builtin model in the time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", default="", help="builtin model cache (default: a fresh one)")
    parser.add_argument("--out", default="benchmarks/results/default_train.json")
    args, overrides = parser.parse_known_args()
    work = Path(tempfile.mkdtemp(prefix="drmas-bench-"))
    cache = args.cache or str(work / "cache")
    run_dir = work / "run"
    cmd = [sys.executable, "-m", "drmas.launch.cli", "train", f"run.dir={run_dir}",
           f"run.cache_dir={cache}", *overrides]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(ps))
        time.sleep(0.5)
    wall = time.monotonic() - start
    output = proc.stdout.read() if proc.stdout else ""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x]
    train = [x for x in lines if "val/tasks" not in x]
    val = [x for x in lines if "val/tasks" in x]
    result: dict = {
        "command": "drmas train " + " ".join(overrides),
        "exit_code": proc.returncode,
        "wall_s": wall,
        "peak_rss_gb": peak / 1e9,
        "steps": len(train),
        "validation": val,
        "summary": json.loads((run_dir / "broker_summary.json").read_text()),
    }
    for agent in ("solver", "verifier"):
        first, last = quarter_means(train, f"reward/{agent}/mean")
        result[f"reward/{agent}/first_quarter"] = first
        result[f"reward/{agent}/last_quarter"] = last
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(output[-3000:])
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("validation", "summary")}, indent=2
        )
    )


if __name__ == "__main__":
    main()
