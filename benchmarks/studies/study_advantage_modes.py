"""Dr. MAS against GRPO and its ablations on this machine's teams, over seeds: the study of
docs/results.md, run, recorded and summarised.

    python benchmarks/studies/study_advantage_modes.py --dry-run            the plan, its time, the budget
    python benchmarks/studies/study_advantage_modes.py [--only GROUP ...]    run what is left (resumable)
    python benchmarks/studies/study_advantage_modes.py --summarize           tables from the recorded runs
    python benchmarks/studies/study_advantage_modes.py --compare docs/results.md   page rows vs tables
    python benchmarks/studies/study_advantage_modes.py --smoke --out /tmp/study     (4 tiny runs)

Two halves, one page:
- team rewards (recorded): every step of an episode is scored with the team's reward;
- role rewards (workflow.rewards=role): each agent is paid for its own job, the setting
  where the paper's lemma predicts that GRPO's shared baseline distorts the agents'
  gradients.

Per run (group, mode, seed), one at a time: `drmas prepare` for the first mode of each seed
(it builds the seed's warm-started models unless cached, timed apart from the run), then
`drmas train` into <out>/runs/<name>/ (ignored by git). Its config, metrics and summaries
are copied into <out>/run_files/<name>/ (committed: `drmas report` reads them), and
<out>/<name>.json is written: final validation, gradient statistics, wall time, the command
with paths relative to the repository, and the git commit with a dirty flag, read before
and after the run. A run whose JSON exists is skipped. --summarize (also done after the
runs) writes study_summary.json and study_summary.md: every table of the page's study part
(benchmarks/studies/study_tables.py) and the numbers its text quotes.

The code under test is this script's own tree (PYTHONPATH points the run's processes at
it). Runs refuse a tree with changes outside benchmarks/results/ unless --allow-dirty. To
run the study while others commit to the repository, run it from a clean worktree and
write into the repository's results:
    git worktree add /tmp/study-tree HEAD
    python /tmp/study-tree/benchmarks/studies/study_advantage_modes.py --out benchmarks/results/study

A seed s changes everything random at once: the warm starts of the group's seeded models
(models.<m>.warmstart.seed; a model is built and cached per seed), the task stream
(task.order_seed: the held-out split stays fixed) and the sampling (actor.engine.seed).
Main comparisons are synchronous (algorithm.max_staleness=0, the paper's setting); the
`async` group repeats one pair at η = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.provenance import git, git_state  # noqa: E402
from benchmarks.studies.study_summary import load_results, summarize  # noqa: E402
from benchmarks.studies.study_tables import (  # noqa: E402
    ablation_table,
    facts,
    main_table,
    one_seed_table,
    paper_table,
    per_seed_line,
    probe_table,
)
from drmas.launch.report_stats import load_run, spike_stats  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "study"
PROBE = REPO / "benchmarks" / "results" / "probe"
BUDGET_MINUTES = 150.0
"""What one half of the study may take on this 2-core machine (the issue's budget)."""

# Validation at the end only (held-out tasks, n = k = 8); the step-0 round, which the
# modes of one seed share (same models, same tasks), is run once per seed in the first mode.
VAL = ("val.every=1000", "val.num_tasks=256", "val.n=8", "val.k=8")
SEARCH_VAL = ("val.every=1000", "val.n=8", "val.k=8")  # its held-out split: 240 tasks
MATH = ("algorithm.max_staleness=0", "train.steps=20", *VAL)
SEARCH = ("experiment=search_tiny", "algorithm.max_staleness=0", "train.steps=30", *SEARCH_VAL)
SEEDS = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class Group:
    name: str
    overrides: tuple[str, ...]
    models: tuple[str, ...]  # whose warm start the seed varies
    modes: tuple[str, ...]
    seeds: tuple[int, ...]
    minutes: float  # one run with cached models, without the step-0 round (measured)
    step0_minutes: float = 0.0  # the step-0 round, in the first mode of each seed; 0 = none
    half: str = "team"  # team | role rewards
    reference: str = ""  # the group whose agent and global runs (same seeds) it pairs with
    table: str = "main"  # how docs/results.md shows it: main | ablation | text (quoted)
    note: str = ""  # after the first metric's name in its table
    cuts: str = ""  # what was cut to fit the budget and what that costs
    step_seconds: float = 0.0  # one training step (median of the recorded runs), for --dry-run


# minutes: medians of the recorded runs with cached models (math 2.5-3.6, search 4.3-9.2:
# the 2 cores are shared, so one run's time varies up to 2x); step 0 and a training step
# (math 4.8-14.1 s, median 7.9; search 7.0-14.6 s, median 10.3): their metrics' times.
PLAN = (
    Group("math", MATH, ("solver", "verifier"), ("agent", "global"), SEEDS, 2.9, 0.4),
    # the seed varied only the Search Agent's warm start: the Verifier and the Answer Agent
    # (one folder: identical warm-start settings) kept seed 0's (4.5 min a build)
    Group("search", SEARCH, ("searcher",), ("agent", "global"), SEEDS, 7.1, 1.0, note=" (EM)"),
    Group("async", ("algorithm.max_staleness=1", "train.steps=20", *VAL), ("solver", "verifier"),
          ("agent", "global"), (0,), 3.0, reference="math", table="text"),
    Group("math_ablation", MATH, ("solver", "verifier"), ("agent_mean", "agent_std", "step_global"),
          (0, 1, 2), 3.0, reference="math", table="ablation"),
    Group("math_shared", ("experiment=tiny_math_shared", *MATH), ("policy",), ("agent", "global"),
          (0,), 2.3, 0.4, table="text"),  # the one-seed pairs' table shows both
    Group("math_hetero", ("experiment=tiny_math_hetero", *MATH), ("solver", "verifier"),
          ("agent", "global"), (0,), 3.5, 0.4, table="text"),
    Group("math_role", (*MATH, "workflow.rewards=role"), ("solver", "verifier"),
          ("agent", "global"), SEEDS, 2.9, 0.4, half="role", step_seconds=7.9,
          cuts="20 steps, not the default 30 (as the team half: the default run has most of "
               "its held-out gain by step 15); validation only at step 0 and at the end; the "
               "warm starts are the team half's math seeds 0-4 (reused if still cached)"),
    Group("search_role", (*SEARCH, "workflow.rewards=role"), ("verifier", "searcher", "answerer"),
          ("agent", "global"), SEEDS, 7.1, 1.0, half="role", note=" (EM)", step_seconds=10.3,
          cuts="30 steps, not the default 40 (as the team half: EM 0.59-0.66 by step 20 in the "
               "default runs); every agent's warm start varies with the seed (the Verifier and "
               "the Answer Agent share one folder per seed: their warm-start settings are "
               "identical), which costs a 4.5-minute build per seed the team half did not pay"),
)  # fmt: skip

SMOKE = Group(
    "smoke",
    ("algorithm.max_staleness=0", "train.steps=2", "group_size=4", "batch_groups=2",
     "val.every=1000", "val.num_tasks=8", "val.n=2", "val.k=2",
     "models.solver.warmstart.steps=20", "models.verifier.warmstart.steps=20"),
    ("solver", "verifier"), ("agent", "global"), (0, 1), 1.0, 0.2,
)  # fmt: skip
"""Checks the script end to end in minutes (not a result)."""

BUILD_S_PER_STEP = {
    ("tiny-qwen2", "math"): 0.109,
    ("tiny-qwen2", "search"): 0.135,
    ("tiny-qwen2", "search_queries"): 0.125,
    ("small-qwen2", "math"): 0.2,
}
"""Seconds per warm-start step of a builtin model, for --dry-run: math from the recorded
runs (seeds 1-4 took 8.2-11.1 min with a 3000-step build, seed 0 2.9 without: 0.109 s a
step), search_tiny's from its config (2000 steps about 4.5 min, the Search Agent's 1200
about 2.5), small-qwen2 from math_hetero seed 0 (about 10 min for 3000 steps)."""

PROBE_FILES = {
    "tiny_math": "tiny_math_sampled.json",
    "search_tiny (G = 5)": "search_tiny_sampled.json",
    "tiny_math, role rewards": "tiny_math_role_sampled.json",
    "search_tiny, role rewards (G = 5)": "search_tiny_role_sampled.json",
}
"""The probe results the study's page shows (benchmarks/results/probe/; missing: left out)."""
ONE_SEED = {
    "math_shared": "`tiny_math_shared` (Solver and Verifier on one model)",
    "math_hetero": "`tiny_math_hetero` (Verifier on a 6× larger model, 2 FSDP ranks)",
}
PAPER_ROWS = {
    "math": "math, Dr. MAS vs GRPO",
    "search": "search, Dr. MAS vs GRPO",
    "math_role": "math, role rewards, Dr. MAS vs GRPO",
    "search_role": "search, role rewards, Dr. MAS vs GRPO",
}
RUN_FILES = ("config.yaml", "metrics.jsonl", "train_summary.json", "broker_summary.json")


def runs(groups: list[Group]) -> list[tuple[str, Group, str, int]]:
    return [(f"{g.name}_{mode}_s{seed}", g, mode, seed)
            for g in groups for seed in g.seeds for mode in g.modes]  # fmt: skip


def overrides(group: Group, mode: str, seed: int, run_dir: str) -> list[str]:
    return [
        *group.overrides,
        f"algorithm.advantage.mode={mode}",
        f"val.at_start={str(group.step0_minutes > 0 and mode == group.modes[0]).lower()}",
        f"task.order_seed={seed}",
        f"actor.engine.seed={seed}",
        *(f"models.{m}.warmstart.seed={seed}" for m in group.models),
        f"run.dir={run_dir}",
        "train.progress=false",
    ]


# ------------------------------------------------------------------ provenance and paths


def results_root(out: Path) -> Path:
    """The repository that holds the results (paths are recorded relative to it)."""
    existing = next(p for p in (out, *out.parents) if p.is_dir())
    top = git(existing, "rev-parse", "--show-toplevel")
    return Path(top.stdout.strip()) if top.returncode == 0 else REPO


def relative(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return str(path)


def copy_run_files(run_dir: Path, dest: Path, roots: tuple[Path, ...]) -> None:
    """The files `drmas report` reads, with the repository's own paths made relative."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        src = run_dir / name
        if not src.is_file():
            continue
        if name == "metrics.jsonl":
            shutil.copyfile(src, dest / name)
            continue
        text = src.read_text()
        for root in roots:
            text = text.replace(f"{root.resolve()}/", "")
        (dest / name).write_text(text)


# ------------------------------------------------------------------ running


RUN_TIMEOUT_S = 3 * 3600
"""One run's bound: a SmolLM2 run of the lemma study takes about an hour alone and 87
minutes beside two CI runs; three hours means it is stuck."""


def _drmas(command: str, args: list[str]) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "drmas.launch.cli", command, *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)  # fmt: skip
    return done, time.monotonic() - start


def run_one(out: Path, name: str, group: Group, mode: str, seed: int) -> bool:
    result = out / f"{name}.json"
    if result.is_file():
        print(f"{name}: done before, skipped", flush=True)
        return True
    run_dir = out / "runs" / name
    if run_dir.exists():  # an interrupted attempt: start it again from scratch
        shutil.rmtree(run_dir)
    root = results_root(out)
    args = overrides(group, mode, seed, relative(run_dir, REPO))
    before, started = git_state(REPO), datetime.now(timezone.utc)
    prepare_s = None
    if mode == group.modes[0]:  # builds the seed's models unless cached, so the run is timed alone
        done, prepare_s = _drmas("prepare", args)
        if done.returncode != 0:
            print(f"{name}: prepare FAILED ({done.returncode})\n{done.stderr[-2000:]}")
            return False
    done, wall = _drmas("train", args)
    if done.returncode != 0:
        print(f"{name}: FAILED ({done.returncode}); see {run_dir / 'logs'}\n{done.stderr[-2000:]}")
        return False
    after = git_state(REPO)
    run = load_run(run_dir)
    steps = int(yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["steps"])
    if not run.validation or run.validation[-1].get("step") != steps:
        print(f"{name}: FAILED: no final validation at step {steps} (the last is "
              f"{run.validation[-1] if run.validation else None}); see {run_dir / 'logs'}\n"
              f"{done.stderr[-2000:]}", flush=True)  # fmt: skip
        return False
    copy_run_files(run_dir, out / "run_files" / name, (root, REPO))
    record = {
        "name": name, "group": group.name, "mode": mode, "seed": seed, "half": group.half,
        "wall_s": wall, "prepare_s": prepare_s, "started_utc": started.isoformat(timespec="seconds"),
        "command": "drmas train " + " ".join(overrides(group, mode, seed, relative(run_dir, root))),
        "run_dir": relative(run_dir, root), "run_files": relative(out / "run_files" / name, root),
        "commit": before["commit"], "dirty": before["dirty"], "dirty_paths": before["dirty_paths"],
        "commit_at_end": after["commit"], "dirty_at_end": after["dirty"],
        "validation": run.validation, "final": run.validation[-1] if run.validation else {},
        "spikes": spike_stats(run),
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    result.write_text(json.dumps(record, indent=2))
    print(f"{name}: {wall:.0f} s (+{prepare_s or 0:.0f} s prepare), {before['commit']}", flush=True)
    return True


# ------------------------------------------------------------------ the plan's time


def models_needed(group: Group, mode: str, seed: int) -> Iterator[tuple[Path, float, bool]]:
    """The builtin model folders this run needs: each with its estimated build minutes
    and whether the cache holds it already (composes the run's config; builds nothing)."""
    from drmas.cache import default_cache_dir
    from drmas.config.load import load_config
    from drmas.models.builtin import BUILTIN_PREFIX, cache_key

    cfg = load_config(overrides(group, mode, seed, "runs/dry-run"))
    root = Path(cfg.run.cache_dir) if cfg.run.cache_dir else default_cache_dir()
    for m in cfg.models.values():
        if not m.path.startswith(BUILTIN_PREFIX):
            continue
        name = m.path[len(BUILTIN_PREFIX) :]
        folder = root / cache_key(name, m.warmstart)
        rate = BUILD_S_PER_STEP.get((name, m.warmstart.workflow), 0.15)
        yield folder, m.warmstart.steps * rate / 60, (folder / "config.json").is_file()


def estimate(groups: list[Group], out: Path, empty_cache: bool) -> dict[str, dict[str, Any]]:
    """Per group: the runs left and their minutes (runs, step-0 rounds, the builds of
    the models they need that are not cached, or all of them with `empty_cache`)."""
    todo = [r for r in runs(groups) if not (out / f"{r[0]}.json").is_file()]
    built: set[Path] = set()
    est: dict[str, dict[str, Any]] = {}
    for name, group, mode, seed in todo:
        e = est.setdefault(group.name, {"runs": [], "run": 0.0, "step0": 0.0, "build": 0.0,
                                        "builds": 0, "seeds": set()})  # fmt: skip
        e["runs"].append(name)
        e["run"] += group.minutes
        if group.step0_minutes and mode == group.modes[0]:
            e["step0"] += group.step0_minutes
        if seed in e["seeds"]:
            continue
        e["seeds"].add(seed)
        for folder, minutes, cached in models_needed(group, mode, seed):
            if folder not in built and (empty_cache or not cached):
                built.add(folder)
                e["build"] += minutes
                e["builds"] += 1
    return est


def dry_run(groups: list[Group], out: Path, empty_cache: bool) -> None:
    """The plan of each half with runs left, as a markdown table, against the budget."""
    est = estimate(groups, out, empty_cache)
    cache = "an empty cache" if empty_cache else "the models this machine's cache holds"
    print(f"Minutes estimated from the recorded runs on this 2-core machine (one run's time "
          f"varies up to 2x with its load), with {cache}.\n")  # fmt: skip
    for half in ("team", "role"):
        mine = [g for g in groups if g.half == half]
        left = [(g, est[g.name]) for g in mine if g.name in est]
        print(f"{half}-reward half: {sum(len(e['runs']) for _, e in left)} of "
              f"{len(runs(mine))} runs left\n")  # fmt: skip
        if not left:
            continue
        print("| group | seeds | steps | warm starts the seed varies | runs | minutes: runs "
              "| step-0 rounds | builds | total |\n|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for g, e in left:
            total = e["run"] + e["step0"] + e["build"]
            steps = next((o.split("=")[1] for o in g.overrides if o.startswith("train.steps=")), "")
            print(f"| `{g.name}` | {len(e['seeds'])} | {steps} | {', '.join(g.models)} "
                  f"| {len(e['runs'])} | {e['run']:.0f} | {e['step0']:.0f} "
                  f"| {e['build']:.0f} ({e['builds']} models) | {total:.0f} |")  # fmt: skip
        total = sum(e["run"] + e["step0"] + e["build"] for _, e in left)
        spare = BUDGET_MINUTES - total
        verdict = f"{spare:.0f} min to spare" if spare >= 0 else f"over by {-spare:.0f} min"
        print(f"\nabout {total:.0f} min against the budget of {BUDGET_MINUTES:.0f}: {verdict}")
        for g, e in left:
            per_seed = (e["run"] + e["step0"] + e["build"]) / len(e["seeds"])
            per_step = len(e["runs"]) * g.step_seconds / 60
            print(f"- {g.name}: one seed fewer saves about {per_seed:.0f} min, one training step "
                  f"fewer {per_step:.1f}, no step-0 rounds {e['step0']:.0f}; cuts made: "
                  f"{g.cuts or 'none'}")  # fmt: skip
        print("\nruns: " + " ".join(n for _, e in left for n in e["runs"]) + "\n")


# ------------------------------------------------------------------ summary and tables


def summarize_all(out: Path) -> dict[str, Any]:
    results = load_results(out)
    lines = {r["name"]: metrics_lines(out, r["name"]) for r in results}
    refs = {g.name: g.reference for g in PLAN if g.reference}
    summary = summarize(results, refs, lines)
    for g in summary["groups"].values():
        span, prov = g["provenance"]["time_span_s"], g["provenance"]
        if span and prov["not_recorded"]:
            since, until = (datetime.fromtimestamp(t, timezone.utc).isoformat() for t in span)
            count = git(REPO, "rev-list", "--count", f"--since={since}", f"--until={until}",
                         "HEAD", "--", "drmas/")  # fmt: skip
            prov["commits_in_span"] = int(count.stdout) if count.returncode == 0 else None
    (out / "study_summary.json").write_text(json.dumps(summary, indent=2))
    (out / "study_summary.md").write_text(markdown(summary))
    return summary


def metrics_lines(out: Path, name: str) -> list[dict[str, Any]]:
    """A run's kept metrics lines (training and validation; none if not kept), for its
    steps per agent and the time span its provenance reports."""
    path = out / "run_files" / name / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def markdown(summary: dict[str, Any]) -> str:
    """Every table of docs/results.md's study part, each group's numbers, then the
    one-seed pairs, the probe and the paper side by side."""
    lines = ["# The advantage-mode study, from its recorded runs", "",
             "Written by `python benchmarks/studies/study_advantage_modes.py --summarize` from the "
             "recorded runs beside this file; docs/results.md shows these tables.", ""]  # fmt: skip
    plan = {g.name: g for g in PLAN}
    for half, title in (("team", "Team rewards"), ("role", "Role rewards (workflow.rewards=role)")):
        names = [n for n, g in plan.items() if g.half == half and n in summary["groups"]]
        lines += [f"## {title}", ""]
        if not names:
            lines += ["No run recorded yet (`--dry-run` shows the plan).", ""]
        for name in names:
            lines += _group_section(name, summary["groups"][name], plan[name])
    for name in sorted(set(summary["groups"]) - set(plan)):
        lines += _group_section(name, summary["groups"][name], None)
    lines += ["## The one-seed pairs", "", *one_seed_table(summary, ONE_SEED), ""]
    lines += ["## `drmas probe` on each team", "", *probe_table(PROBE, PROBE_FILES), ""]
    lines += ["## Side by side with the paper", "", *paper_table(summary, PAPER_ROWS), ""]
    return "\n".join(lines)


def _group_section(name: str, g: dict[str, Any], group: Group | None) -> list[str]:
    table = "main" if group is None else group.table
    rows = ablation_table(g) if table == "ablation" else main_table(g, group.note if group else "")
    seeds = per_seed_line(g)
    return [f"### {name}", "", *rows, "", *([f"({seeds}.)", ""] if seeds else []),
            *facts(name, g), ""]  # fmt: skip


def page_tables(summary: dict[str, Any]) -> list[str]:
    """The rows of the tables docs/results.md shows: each `main` group's table (the
    others are quoted in its text), the ablations, the one-seed pairs, the probe and the
    paper side by side."""
    rows = []
    for group in PLAN:
        g = summary["groups"].get(group.name)
        if g and group.table == "main":
            rows += main_table(g, group.note)
        elif g and group.table == "ablation":
            rows += ablation_table(g)
    rows += one_seed_table(summary, ONE_SEED) + probe_table(PROBE, PROBE_FILES)
    return rows + paper_table(summary, PAPER_ROWS)


def compare(page: Path, summary: dict[str, Any]) -> list[str]:
    """The rows of the page's tables (page_tables; not the separators) that `page` does
    not show verbatim."""
    shown = {line.strip() for line in page.read_text().splitlines()}
    rows = [x.strip() for x in page_tables(summary) if not x.startswith("|---")]
    return [row for row in rows if row not in shown]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="groups to run (default: all)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated time")
    p.add_argument("--empty-cache", action="store_true", help="--dry-run: count every build")
    p.add_argument("--summarize", action="store_true", help="only rewrite the study's summary")
    p.add_argument("--compare", default="", help="a page whose table rows to check (then exit)")
    p.add_argument("--plots", default="", help="write the study's figures into this folder")
    p.add_argument("--smoke", action="store_true", help="two tiny runs per mode instead")
    p.add_argument("--allow-dirty", action="store_true", help="run on a tree with changes")
    p.add_argument("--out", default=str(OUT), help="results folder")
    args = p.parse_args()
    out = Path(args.out).resolve()
    groups = [g for g in ((SMOKE,) if args.smoke else PLAN) if not args.only or g.name in args.only]
    if args.plots:
        from benchmarks.studies.study_plots import plots

        for path in plots(out, Path(args.plots)):
            print(path)
        return 0
    if args.summarize or args.compare:
        summary = summarize_all(out)
        if not args.compare:
            print((out / "study_summary.md").read_text())
            return 0
        missing = compare(Path(args.compare), summary)
        for row in missing:
            print(f"not on the page: {row}")
        print(f"{len(missing)} table rows of the summary are not on {args.compare}")
        return 1 if missing else 0
    if args.dry_run:
        dry_run(groups, out, args.empty_cache)
        return 0
    state = git_state(REPO)
    if state["dirty"] and not (args.allow_dirty or args.smoke):
        print(f"{REPO} has changes ({', '.join(state['dirty_paths'][:5])}): the runs would not "
              "match a commit. Commit them, or run from a clean worktree (see --help), or pass "
              "--allow-dirty (recorded in each run)", file=sys.stderr)  # fmt: skip
        return 2
    ok = [run_one(out, *r) for r in runs(groups)]
    summarize_all(out)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
