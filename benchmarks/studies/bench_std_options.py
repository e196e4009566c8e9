"""The search team's gradient spikes under plain Dr. MAS, a batch-pooled σ_k and a floored σ_k,
over seeds: spike steps per agent and held-out EM.

    python benchmarks/studies/bench_std_options.py [--seeds 0 1 2] [--out benchmarks/results/std_options.json]
    python benchmarks/studies/bench_std_options.py --summarize    # only recompute from the records

Per seed, three `drmas train experiment=search_tiny` runs, identical but for the σ option:
- plain: Dr. MAS as written (σ_k from each group's steps of agent k);
- pooled: `algorithm.advantage.agent_std_pool=batch` (σ_k from the batch's group-centred
  scores of agent k; the per-group mean stays);
- floored: `algorithm.advantage.std_floor=0.3`.
30 steps, on-policy (`algorithm.max_staleness=0`, so the machine's load cannot change what
they learn), held-out EM once at the end (n = k = 8 over the 240 held-out tasks). A seed
varies the Search Agent's warm start (the Verifier's and the Answer Agent's are seed 0's,
as in the team study, whose cached models this reuses), the task stream and the sampling.

Per run: spike steps per agent (`agent_grad_norm/<agent>` over 3× the median of the 10
steps before, as `drmas report` counts them), the largest and median norm, final EM. Over
seeds: each option's paired difference from plain (EM: mean and 95 % t-interval; spikes: a
sign test). `benchmarks/studies/spike_diagnostics.py` on the plain runs (pooled) says what the
spikes line up with; its output is kept in the results too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.studies.study_stats import mean_ci, sign_test, significant  # noqa: E402
from benchmarks.studies.variant_runs import relative, run_variants  # noqa: E402
from drmas.launch.report_stats import load_run, spike_stats  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "std_options.json"
AGENTS = ("verifier", "searcher", "answerer")
COMMON = (
    "experiment=search_tiny",
    "algorithm.max_staleness=0",
    "train.steps=30",
    "val.every=1000",
    "val.at_start=false",
    "val.n=8",
    "val.k=8",
    "train.progress=false",
)
VARIANTS = {
    "plain": (),
    "pooled": ("algorithm.advantage.agent_std_pool=batch",),
    "floored": ("algorithm.advantage.std_floor=0.3",),
}


def overrides(variant: str, seed: int, run_dir: Path) -> list[str]:
    return [
        *COMMON,
        *VARIANTS[variant],
        f"task.order_seed={seed}",
        f"actor.engine.seed={seed}",
        f"models.searcher.warmstart.seed={seed}",
        f"run.dir={run_dir}",
    ]


def final_em(run_dir: Path) -> float:
    run = load_run(run_dir)
    if not run.validation:
        raise SystemExit(f"{run_dir}: no validation line")
    last = run.validation[-1]
    return float(last["val/avg@8"])  # the study's search metric: avg@8 of exact match


def measure(run_dir: Path) -> dict[str, Any]:
    """Final avg@8 and each agent's gradient-norm statistics (spikes, largest, median)."""
    stats = spike_stats(load_run(run_dir))
    return {
        "em": final_em(run_dir),
        "agents": {a: stats.get(f"agent {a}", {}) for a in AGENTS},
        "run_dir": relative(run_dir),
    }


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    by = {(r["variant"], r["seed"]): r for r in records}
    out: dict[str, Any] = {"setup": list(COMMON), "variants": {}}
    for variant in VARIANTS:
        seeds = sorted(s for v, s in by if v == variant)
        rs = [by[(variant, s)] for s in seeds]
        entry: dict[str, Any] = {
            "seeds": seeds,
            "em": mean_ci([r["em"] for r in rs]),
            "spikes": {a: [r["agents"][a].get("spikes", 0) for r in rs] for a in AGENTS},
            "max_norm": {a: [r["agents"][a].get("max") for r in rs] for a in AGENTS},
            "median_norm": {a: [r["agents"][a].get("median") for r in rs] for a in AGENTS},
        }
        if variant != "plain":
            paired = [s for s in seeds if ("plain", s) in by]
            entry["em_minus_plain"] = significant(
                mean_ci([by[(variant, s)]["em"] - by[("plain", s)]["em"] for s in paired])
            )
            entry["spikes_vs_plain"] = {
                a: sign_test([by[(variant, s)]["agents"][a].get("spikes", 0) for s in paired],
                             [by[("plain", s)]["agents"][a].get("spikes", 0) for s in paired])
                for a in AGENTS
            }  # fmt: skip
        out["variants"][variant] = entry
    return out


def diagnostics(folder: Path, seeds: list[int]) -> str:
    """spike_diagnostics.py's table over the plain runs, pooled."""
    dirs = [str(folder / "runs" / f"plain_s{s}") for s in seeds]
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "studies" / "spike_diagnostics.py"), *dirs],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    return done.stdout if done.returncode == 0 else f"failed: {done.stderr[-2000:]}"


def main() -> None:
    out, records = run_variants(__doc__.split("\n\n")[0], OUT, VARIANTS, overrides, measure)
    summary = summarize(records)
    plain_seeds = summary["variants"]["plain"]["seeds"]
    folder = out.with_suffix("")
    if all((folder / "runs" / f"plain_s{s}").is_dir() for s in plain_seeds):
        summary["spike_diagnostics_plain"] = diagnostics(folder, plain_seeds)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
