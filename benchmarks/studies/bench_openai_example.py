"""Does examples/openai_team learn? Its held-out score before and after its 20 steps, over seeds.

    python benchmarks/studies/bench_openai_example.py [--seeds 0 1 2 3] [--out benchmarks/results/openai_example.json]
    python benchmarks/studies/bench_openai_example.py --summarize   # only recompute from the recorded runs

Per seed, one `drmas train --config examples/openai_team/config.yaml` as a user runs it
(the program through the OpenAI client, in process), with the seed varying the warm start,
the task order and the sampling, and validation at step 0, 10 and 20 on the held-out split
(n = k = 4, more samples than the example's own n = 2 so one run's score is less noisy).
The example is asynchronous (max_staleness 1): how busy the machine is can change which
version a group was sampled from, not the design; each record says its load.

Per seed: held-out avg@4 at steps 0 and 20, and the Checker's approval rate and the
Solver's own accuracy beside it (the team is paid only for an approved right answer, so
either agent can move the score). Over seeds: mean and 95 % t-interval of the paired
rise (step 20 - step 0) (benchmarks/studies/study_stats.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.studies.study_stats import mean_ci, significant  # noqa: E402
from benchmarks.studies.variant_runs import run_variants  # noqa: E402
from drmas.launch.report_stats import load_run  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "openai_example.json"
K = 4
METRICS = (f"val/avg@{K}", "val/approved", "val/solver_right")
COMMON = (
    "--config",
    "examples/openai_team/config.yaml",
    "val.every=10",
    "val.at_start=true",
    f"val.n={K}",
    f"val.k={K}",
    "train.progress=false",
)


def overrides(variant: str, seed: int, run_dir: Path) -> list[str]:
    return [
        *COMMON,
        f"task.order_seed={seed}",
        f"actor.engine.seed={seed}",
        f"models.policy.warmstart.seed={seed}",
        f"run.dir={run_dir}",
    ]


def measure(run_dir: Path) -> dict[str, Any]:
    """Each validation's step and metrics, and the load while the run went."""
    run = load_run(run_dir)
    curve = [
        {"step": int(v["step"]), **{m: v[m] for m in METRICS if m in v}} for v in run.validation
    ]
    return {"curve": curve, "load_at_end": os.getloadavg()[0]}


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    per_seed: dict[str, Any] = {}
    for record in sorted(records, key=lambda r: r["seed"]):
        first, last = record["curve"][0], record["curve"][-1]
        per_seed[str(record["seed"])] = {
            m: {"start": first.get(m), "end": last.get(m), "steps": [first["step"], last["step"]]}
            for m in METRICS
        }
    rise = {
        m: significant(mean_ci([p[m]["end"] - p[m]["start"] for p in per_seed.values()]))
        for m in METRICS
    }
    start = mean_ci([p[METRICS[0]]["start"] for p in per_seed.values()])
    return {"metric": METRICS[0], "setup": list(COMMON), "seeds": sorted(map(int, per_seed)),
            "start": start, "rise": rise, "per_seed": per_seed}  # fmt: skip


def main() -> None:
    out, records = run_variants(__doc__.split("\n\n")[0], OUT, ["example"], overrides, measure)
    summary = summarize(records)
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: summary[k] for k in summary if k != "per_seed"}, indent=2))


if __name__ == "__main__":
    main()
