"""Dr. MAS against GRPO and its ablations on this machine's teams, over seeds.

    python benchmarks/study_advantage_modes.py [--only GROUP ...] [--dry-run] [--summarize]
    python benchmarks/study_advantage_modes.py --smoke --out /tmp/study   (2 tiny runs)

Runs `drmas train` once per (group, mode, seed) in the plan below, one at a time, each
into benchmarks/results/study/runs/<name>/ (kept: `drmas report` reads them), and writes
benchmarks/results/study/<name>.json when the run has finished. Resumable: a run whose
JSON exists is skipped, so the study can be stopped and continued. --summarize (also done
after the runs) writes benchmarks/results/study/study_summary.json:
- per group and mode: final validation avg@k and pass@k, mean ± 95 % CI over seeds
  (Student t), and the gradient-spike statistics of `drmas report`;
- per group: the paired difference agent − global over the seeds both have, with its
  95 % CI, and whether the interval excludes 0.

A seed s changes everything random at once: the warm-started models
(models.<m>.warmstart.seed; a new model is built and cached per seed), the task stream
(task.order_seed: the held-out split stays fixed) and the sampling (actor.engine.seed). Main comparisons are synchronous
(algorithm.max_staleness=0, the paper's setting); the `async` group repeats one pair at
η = 1.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmarks" / "results" / "study"
sys.path.insert(0, str(REPO))

from drmas.launch.report_stats import load_run, spike_stats  # noqa: E402

# Validation at the end only (256 held-out tasks, n = k = 8); the step-0 round, which the
# modes of one seed share (same model, same tasks), is run once per seed in the first mode.
VAL = ("val.every=1000", "val.num_tasks=256", "val.n=8", "val.k=8")
SEARCH_VAL = ("val.every=1000", "val.n=8", "val.k=8")  # its held-out split: 240 tasks


@dataclass(frozen=True)
class Group:
    name: str
    overrides: tuple[str, ...]
    models: tuple[str, ...]  # whose warm start the seed varies
    modes: tuple[str, ...]
    seeds: tuple[int, ...]
    minutes: float  # measured cost of one run with cached models (estimate for --dry-run)
    build_minutes: float  # one new warm-started model set per seed
    step0: bool = True  # validate at step 0 in the first mode of each seed


MATH = ("algorithm.max_staleness=0", "train.steps=20", *VAL)
PLAN = (
    Group("math", MATH, ("solver", "verifier"), ("agent", "global"), (0, 1, 2, 3, 4), 2.8, 3.7),
    # the seed varies the Search Agent's warm start (the agent RL changes most), not the
    # Verifier/Answer Agent's (4.5 min per seed, which the budget cannot pay five times)
    Group("search", ("experiment=search_tiny", "algorithm.max_staleness=0", "train.steps=30",
                     *SEARCH_VAL),
          ("searcher",), ("agent", "global"), (0, 1, 2, 3, 4), 5.5, 2.5),
    Group("async", ("algorithm.max_staleness=1", "train.steps=20", *VAL), ("solver", "verifier"),
          ("agent", "global"), (0,), 2.5, 0.0, step0=False),
    Group("math_ablation", MATH, ("solver", "verifier"), ("agent_mean", "agent_std", "step_global"),
          (0, 1, 2), 2.5, 0.0, step0=False),
    Group("math_shared", ("experiment=tiny_math_shared", *MATH), ("policy",), ("agent", "global"),
          (0,), 3.0, 0.0),
    Group("math_hetero", ("experiment=tiny_math_hetero", *MATH), ("solver", "verifier"),
          ("agent", "global"), (0,), 4.0, 6.0),
)  # fmt: skip


SMOKE = Group(
    "smoke",
    ("algorithm.max_staleness=0", "train.steps=2", "group_size=4", "batch_groups=2",
     "val.every=1000", "val.num_tasks=8", "val.n=2", "val.k=2",
     "models.solver.warmstart.steps=20", "models.verifier.warmstart.steps=20"),
    ("solver", "verifier"), ("agent", "global"), (0, 1), 1.0, 0.2,
)  # fmt: skip
"""Checks the script end to end in minutes (not a result)."""


def runs(groups: list[Group]) -> list[tuple[str, Group, str, int]]:
    return [(f"{g.name}_{mode}_s{seed}", g, mode, seed)
            for g in groups for seed in g.seeds for mode in g.modes]  # fmt: skip


def overrides(group: Group, mode: str, seed: int, run_dir: Path) -> list[str]:
    return [
        *group.overrides,
        f"algorithm.advantage.mode={mode}",
        f"val.at_start={str(group.step0 and mode == group.modes[0]).lower()}",
        f"task.order_seed={seed}",
        f"actor.engine.seed={seed}",
        *(f"models.{m}.warmstart.seed={seed}" for m in group.models),
        f"run.dir={run_dir}",
        "train.progress=false",
    ]


def run_one(name: str, group: Group, mode: str, seed: int) -> None:
    result = OUT / f"{name}.json"
    if result.is_file():
        print(f"{name}: done before, skipped", flush=True)
        return
    run_dir = OUT / "runs" / name
    if run_dir.exists():  # an interrupted attempt: start it again from scratch
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    argv = [
        sys.executable,
        "-m",
        "drmas.launch.cli",
        "train",
        *overrides(group, mode, seed, run_dir),
    ]
    start = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=3600)
    wall = time.monotonic() - start
    if done.returncode != 0:
        print(f"{name}: FAILED ({done.returncode}); see {run_dir / 'logs'}\n{done.stderr[-2000:]}")
        return
    run = load_run(run_dir)
    final = run.validation[-1] if run.validation else {}
    OUT.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps({
        "name": name, "group": group.name, "mode": mode, "seed": seed, "wall_s": wall,
        "command": "drmas train " + " ".join(argv[4:]),
        "validation": run.validation, "final": final, "spikes": spike_stats(run),
    }, indent=2))  # fmt: skip
    print(f"{name}: {wall:.0f} s, final {_val_line(final)}", flush=True)


def _val_line(line: dict) -> str:
    return ", ".join(
        f"{k} {v:.3f}" for k, v in line.items() if k.startswith("val/") and k.count("/") == 1
    )


def mean_ci(values: list[float]) -> dict[str, float | int | None]:
    """Mean and 95 % Student-t interval over independent seeds."""
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "lo": None, "hi": None}
    mean = statistics.fmean(values)
    if n == 1:
        return {"n": 1, "mean": mean, "lo": None, "hi": None}
    half = _t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
    return {"n": n, "mean": mean, "lo": mean - half, "hi": mean + half}


def _t975(df: int) -> float:
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
             9: 2.262, 10: 2.228}  # fmt: skip
    return table.get(df, 1.96 + 2.5 / df)


def summarize() -> dict:
    results = [
        json.loads(p.read_text())
        for p in sorted(OUT.glob("*.json"))
        if p.name != "study_summary.json"
    ]
    out: dict = {"groups": {}}
    for group in sorted({r["group"] for r in results}):
        mine = [r for r in results if r["group"] == group]
        keys = sorted({k for r in mine for k in r["final"] if k.startswith(("val/avg@", "val/pass@"))
                       and k.count("/") == 1})  # fmt: skip
        modes = {}
        for mode in sorted({r["mode"] for r in mine}):
            rs = [r for r in mine if r["mode"] == mode]
            modes[mode] = {k: mean_ci([r["final"][k] for r in rs if k in r["final"]]) for k in keys}
            modes[mode]["seeds"] = sorted(r["seed"] for r in rs)
            modes[mode]["wall_s"] = mean_ci([r["wall_s"] for r in rs])
            modes[mode]["spikes"] = _spikes(rs)
        by = {(r["mode"], r["seed"]): r for r in mine}
        seeds = sorted(s for (m, s) in by if m == "agent" and ("global", s) in by)
        paired = {}
        for k in keys:
            paired[k] = _significant(mean_ci(
                [by[("agent", s)]["final"][k] - by[("global", s)]["final"][k] for s in seeds]))  # fmt: skip
        # gradient spikes: agent / global ratio of each model's largest pre-clip norm, as a
        # paired mean of log ratios over seeds (exp of the mean and of its interval)
        for unit in sorted({u for r in mine for u in r["spikes"] if u.startswith("model ")}):
            logs = [math.log(by[("agent", s)]["spikes"][unit]["max"]
                             / by[("global", s)]["spikes"][unit]["max"]) for s in seeds
                    if unit in by[("agent", s)]["spikes"] and unit in by[("global", s)]["spikes"]]  # fmt: skip
            ci = _significant(mean_ci(logs))
            paired[f"max_grad_norm_ratio/{unit[6:]}"] = {
                k: (math.exp(v) if isinstance(v, float) and k in ("mean", "lo", "hi") else v)
                for k, v in ci.items()
            }
        step0 = {str(r["seed"]): r["validation"][0] for r in mine
                 if r["validation"] and r["validation"][0]["step"] == 0}  # fmt: skip
        out["groups"][group] = {
            "modes": modes,
            "agent_minus_global": paired,
            "paired_seeds": seeds,
            "step0": step0,
            "step0_mean": {k: mean_ci([v[k] for v in step0.values() if k in v]) for k in keys},
        }
    (OUT / "study_summary.json").write_text(json.dumps(out, indent=2))
    (OUT / "study_summary.md").write_text(markdown(out))
    return out


def _ci(c: dict, digits: int = 3) -> str:
    if c.get("mean") is None:
        return "-"
    if c.get("lo") is None:
        return f"{c['mean']:.{digits}f} (1 seed)"
    return f"{c['mean']:.{digits}f} [{c['lo']:.{digits}f}, {c['hi']:.{digits}f}]"


def markdown(summary: dict) -> str:
    """The study's tables: per group, each mode's final validation (mean [95 % CI] over
    seeds) and gradient statistics, then agent - global paired over seeds."""
    lines = []
    for group, g in summary["groups"].items():
        keys = sorted(k for k in g["step0_mean"] if k != "val/pass@1")
        lines += [f"### {group}", "", "| mode | seeds | " + " | ".join(f"final {k[4:]}" for k in keys)
                  + " | max / median pre-clip grad norm | spikes |",
                  "|---|---|" + "---|" * len(keys) + "---|---|"]  # fmt: skip
        if g["step0"]:
            lines.append("| step 0 (before RL) | " + ",".join(sorted(g["step0"])) + " | "
                         + " | ".join(_ci(g["step0_mean"][k]) for k in keys) + " | | |")  # fmt: skip
        for mode, m in g["modes"].items():
            grads = ", ".join(
                f"{u} {v['max']:.2f}/{v['median']:.2f}" for u, v in m["spikes"].items()
            )
            spikes = sum(v["spikes"] for v in m["spikes"].values())
            lines.append(f"| {mode} | {len(m['seeds'])} | " + " | ".join(_ci(m[k]) for k in keys)
                         + f" | {grads} | {spikes} |")  # fmt: skip
        paired = g["agent_minus_global"]
        if g["paired_seeds"]:
            lines += [
                "",
                f"agent − global, paired over seeds {g['paired_seeds']} (95 % t-interval):",
                "",
            ]
            for k, c in paired.items():
                if k == "val/pass@1":
                    continue
                what = "×" if k.startswith("max_grad") else ""
                verdict = "significant" if c["significant"] else "not significant"
                lines.append(f"- {k}: {_ci(c)}{what} ({verdict})")
        lines.append("")
    return "\n".join(lines) + "\n"


def _significant(ci: dict) -> dict:
    lo, hi = ci["lo"], ci["hi"]
    return {**ci, "significant": lo is not None and hi is not None and (lo > 0 or hi < 0)}


def _spikes(runs: list[dict]) -> dict:
    """Per model, over the seeds of one mode: mean largest and median pre-clip gradient
    norm, total spike steps (> 3x the median of the 10 before) and non-finite skips."""
    out = {}
    for unit in sorted({u for r in runs for u in r["spikes"] if u.startswith("model ")}):
        stats = [r["spikes"][unit] for r in runs if unit in r["spikes"]]
        out[unit[6:]] = {
            "max": statistics.fmean(s["max"] for s in stats),
            "median": statistics.fmean(s["median"] for s in stats),
            "max_over_median": statistics.fmean(
                s["max"] / s["median"] for s in stats if s["median"]
            ),
            "spikes": sum(s["spikes"] for s in stats),
            "skipped_nonfinite": sum(s.get("skipped_nonfinite", 0) for s in stats),
        }
    return out


def plots(out_dir: Path) -> list[Path]:
    """The study's figures: per group, the paired final avg@k of each seed (agent against
    global), and each model's pre-clip gradient norm over steps (Dr. MAS blue, GRPO
    orange, one thin line per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))
               if p.name != "study_summary.json"]  # fmt: skip
    colors = {"agent": "tab:blue", "global": "tab:orange"}
    written = []

    def paired_seeds(group: str) -> int:
        modes = [{r["seed"] for r in results if r["group"] == group and r["mode"] == m}
                 for m in ("agent", "global")]  # fmt: skip
        return len(modes[0] & modes[1])

    groups = sorted({r["group"] for r in results if paired_seeds(r["group"]) >= 2})
    fig, axes = plt.subplots(1, len(groups), figsize=(4 * len(groups), 3.4), squeeze=False)
    for ax, group in zip(axes[0], groups):
        by = {(r["mode"], r["seed"]): r for r in results if r["group"] == group}
        key = next(k for k in by[next(iter(by))]["final"] if k.startswith("val/avg@"))
        seeds = sorted(s for m, s in by if m == "agent" and ("global", s) in by)
        for s in seeds:
            a, g = by[("agent", s)]["final"][key], by[("global", s)]["final"][key]
            ax.plot([0, 1], [g, a], color="grey", lw=1)
            ax.scatter([0], [g], color=colors["global"], zorder=3)
            ax.scatter([1], [a], color=colors["agent"], zorder=3)
        ax.set_xticks([0, 1], ["GRPO (global)", "Dr. MAS (agent)"])
        ax.set_xlim(-0.4, 1.4)
        ax.set_title(f"{group}: final {key[4:]} per seed")
        ax.set_ylabel(f"held-out {key[4:]}")
    fig.tight_layout()
    written.append(out_dir / "results_paired.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    for group in groups:
        runs = [r for r in results if r["group"] == group and r["mode"] in colors]
        models = sorted({k.split("/", 1)[1] for r in runs for line in _steps(r) for k in line
                         if k.startswith("grad_norm/")})  # fmt: skip
        fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.2), squeeze=False)
        for ax, model in zip(axes[0], models):
            for r in runs:
                lines = _steps(r)
                xs = [x["step"] for x in lines if f"grad_norm/{model}" in x]
                ys = [x[f"grad_norm/{model}"] for x in lines if f"grad_norm/{model}" in x]
                ax.plot(xs, ys, color=colors[r["mode"]], lw=1, alpha=0.7)
            ax.set_yscale("log")
            ax.set_title(f"grad_norm/{model}")
            ax.set_xlabel("step")
            ax.set_ylabel("pre-clip grad norm (log)")
        handles = [plt.Line2D([], [], color=c, label=f"{m} ({len({r['seed'] for r in runs if r['mode'] == m})} seeds)") for m, c in colors.items()]  # fmt: skip
        fig.legend(handles=handles, loc="lower center", ncol=2)
        fig.suptitle(f"{group}: gradient norm per model, Dr. MAS (agent) and GRPO (global)")
        fig.tight_layout(rect=(0, 0.08, 1, 1))
        written.append(out_dir / f"results_{group}_grad_norm.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def _steps(result: dict) -> list[dict]:
    """The training lines of a study run (from its kept metrics.jsonl)."""
    path = OUT / "run_files" / result["name"] / "metrics.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [x for x in lines if "val/tasks" not in x]


def main() -> int:
    global OUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="groups to run (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time")
    p.add_argument("--summarize", action="store_true", help="only rewrite study_summary.json")
    p.add_argument("--plots", default="", help="write the study's figures into this folder")
    p.add_argument("--smoke", action="store_true", help="two tiny runs per mode instead")
    p.add_argument("--out", default=str(OUT), help="results folder")
    args = p.parse_args()
    OUT = Path(args.out)
    plan = (SMOKE,) if args.smoke else PLAN
    groups = [g for g in plan if not args.only or g.name in args.only]
    if args.plots:
        for path in plots(Path(args.plots)):
            print(path)
        return 0
    if args.summarize:
        print(json.dumps(summarize(), indent=2))
        return 0
    todo = runs(groups)
    if args.dry_run:
        left = [r for r in todo if not (OUT / f"{r[0]}.json").is_file()]
        minutes = sum(g.minutes for _, g, _, _ in left)
        minutes += sum(g.build_minutes * len(g.seeds) for g in groups)
        print(f"{len(left)} of {len(todo)} runs left, about {minutes:.0f} min with builds:")
        for name, *_ in left:
            print(" ", name)
        return 0
    for name, group, mode, seed in todo:
        run_one(name, group, mode, seed)
    summarize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
