"""One `drmas` command of this tree per (variant, seed), recorded once: what the measurement
scripts that compare a setting over seeds share (bench_skip_zero_variance.py,
bench_std_options.py; probe_teams.py uses `run_drmas`).

The command runs this script's own tree (PYTHONPATH points at it, so a clean worktree can
measure while others commit), and every record carries the git commit and the command with
paths relative to the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.provenance import git_state  # noqa: E402


def relative(path: object) -> str:
    """`path` (or an override holding one) without this machine's repository prefix."""
    return str(path).replace(f"{REPO.resolve()}/", "")


def run_drmas(command: str, args: list[str], what: str, timeout_s: float = 3600) -> float:
    """`drmas <command> <args>` of this tree; its wall seconds, or exit naming `what`
    (also when it runs past `timeout_s`)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "drmas.launch.cli", command, *args], cwd=REPO,
                              env=env, capture_output=True, text=True, timeout=timeout_s)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-3000:]
        text = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        raise SystemExit(
            f"{what} ran past its {timeout_s / 60:.0f} minutes and was stopped:\n{text}"
        ) from e
    if done.returncode != 0:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return time.monotonic() - start


def train_once(
    folder: Path,
    variant: str,
    seed: int,
    args: Callable[[Path], list[str]],
    measure: Callable[[Path], dict[str, Any]],
) -> dict[str, Any]:
    """`drmas train` with `args(run_dir)` into folder/runs/<variant>_s<seed>, recorded as
    folder/<variant>_s<seed>.json with what `measure(run_dir)` reads; an existing record is
    returned as it is (the scripts resume run by run)."""
    record_path = folder / f"{variant}_s{seed}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    run_dir = folder / "runs" / f"{variant}_s{seed}"
    overrides = args(run_dir)
    state = git_state()  # before the run: the code it ran, even if HEAD moves meanwhile
    wall = run_drmas("train", overrides, f"{variant} seed {seed}")
    record = {
        "variant": variant, "seed": seed, **state,
        "command": "drmas train " + " ".join(relative(a) for a in overrides), "wall_s": wall,
        **measure(run_dir),
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    record_path.write_text(json.dumps(record, indent=2))
    print(f"{variant} s{seed}: {wall:.0f} s", flush=True)
    return record


def run_variants(
    description: str,
    out_default: Path,
    variants: Iterable[str],
    overrides: Callable[[str, int, Path], list[str]],
    measure: Callable[[Path], dict[str, Any]],
) -> tuple[Path, list[dict[str, Any]]]:
    """The command line the comparison scripts share (--seeds, --out, --summarize): train
    every variant on every seed (`train_once`, which resumes run by run) unless --summarize,
    then return the results file and every run recorded beside it (its folder: the file's
    name without .json)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--out", default=str(out_default))
    p.add_argument("--summarize", action="store_true", help="only recompute from the records")
    args = p.parse_args()
    out = Path(args.out)
    folder = out.with_suffix("")
    if not args.summarize:
        for seed in args.seeds:
            for variant in variants:
                train_once(folder, variant, seed,
                           lambda d, v=variant, s=seed: overrides(v, s, d), measure)  # fmt: skip
    return out, [json.loads(f.read_text()) for f in sorted(folder.glob("*_s*.json"))]
