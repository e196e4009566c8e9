"""Dose-response of Dr. MAS against shared baselines over the Verifier's reward scale, and
the two ablations that split the shared baseline's mean offset from its rescaling.

    python benchmarks/studies/probe_teams.py --only dose_c1 dose_c0.3 dose_c0.1 dose_c0.03 \\
        --out benchmarks/results/study/dose/probe          the predictions, before any run
    python benchmarks/studies/study_dose.py --dry-run                  the runs left, in order
    python benchmarks/studies/study_dose.py [--seeds 0 1 ...] [--only dose_c0.3 ...]
    python benchmarks/studies/study_dose.py --summarize                the tables from the runs

The design of the lemma study (study_lemma.py): experiment=tiny_math_shared (Solver and
Verifier on one model, one optimiser), role rewards, no invalid-action penalty, 20
synchronous steps, held-out avg@8 on 256 tasks; the Verifier's rewards multiplied by
c in {1, 0.3, 0.1, 0.03} (workflow.reward_scale.verifier). Arms at every c: `agent`,
`step_global` (one mean and std over all steps of the group), `global`. At c = 0.1 and
0.03 also the two ablations that make a 2 x 2 with `agent` and `step_global`. Exactly,
step_global = (sigma_k/sigma_all) * agent + (mu_k - mu_all)/sigma_all: a rescaling of
the agent's centred scores plus an offset, the same for all of agent k's steps in a group.

                        offset kept       offset removed
    rescaling kept      step_global       agent_centred
    rescaling removed   agent_shifted     agent

so the gap agent - step_global splits exactly into an offset effect (removing it,
averaged over the two rescaling levels) and a rescaling effect (the same the other way);
their interaction is reported too. The issue named `agent_mean` and `agent_std` for this;
they are not this split (they take global's statistics over episode means, and agent_std
divides the offset by sigma_k, unbounded where an agent's scores tie: the probe's factor
for the Solver was 3.7e8), so the study runs the exact one.

None of the lemma study's runs are reused: at seed 0 its step-0 held-out score was 0.555
and the same command at this study's first commit gives 0.466 (the seed's warm start is
built differently since), so every cell is run again here, at one commit.

A seed changes the warm start, the task order and the sampling, and is paired across
every arm and scale (one warm start per seed, cached). Runs go seed by seed, so a study
stopped early has complete pairs; each run is recorded by run_one (its commit, clean
tree, final held-out validation) into <out>/<name>.json and skipped when that file
exists: commit the files as they finish.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.studies.study_advantage_modes import Group, git_state  # noqa: E402
from benchmarks.studies.study_lemma import SHARED, finals, paired, study_main  # noqa: E402
from benchmarks.studies.study_stats import holm, mean_ci, paired_p, significant  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "study" / "dose"
SCALES = ("1", "0.3", "0.1", "0.03")
ABLATED = ("0.1", "0.03")
SEEDS = tuple(range(8))
ARMS = ("agent", "step_global", "global")
ABLATIONS = ("agent_centred", "agent_shifted")


def group_name(c: str) -> str:
    return f"dose_c{c}"


PLAN = tuple(
    Group(
        group_name(c),
        (*SHARED, f"workflow.reward_scale.verifier={c}"),
        ("policy",),
        (*ARMS, *(ABLATIONS if c in ABLATED else ())),
        SEEDS,
        3.5,
        0.4,
        half="lemma",
    )
    for c in SCALES
)


def factorial(values: dict[str, dict[int, float]]) -> dict[str, Any]:
    """The 2 x 2 split of agent - step_global (see the module's doc), per seed then over
    seeds: what removing the offset and removing the rescaling each gain (main effects,
    they add up to the gap), their interaction, and each main effect's share of the gap
    (a ratio of means: percentile bootstrap over seeds, pairs kept)."""
    arms = ("agent", "step_global", "agent_centred", "agent_shifted")
    seeds = sorted(set.intersection(*(set(values.get(a, {})) for a in arms)))
    if len(seeds) < 2:
        return {"seeds": seeds}
    a, sg, centred, shifted = (np.array([values[arm][s] for s in seeds]) for arm in arms)
    parts = {
        "gap": a - sg,
        "offset": ((a - shifted) + (centred - sg)) / 2,
        "scale": ((a - centred) + (shifted - sg)) / 2,
        "interaction": a - shifted - centred + sg,
    }
    out: dict[str, Any] = {k: significant(mean_ci(list(map(float, v)))) for k, v in parts.items()}
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(seeds), size=(10_000, len(seeds)))
    gap = parts["gap"][picks].mean(1)
    for k in ("offset", "scale"):
        point = float(parts[k].mean() / parts["gap"].mean()) if parts["gap"].mean() else None
        with np.errstate(divide="ignore", invalid="ignore"):
            boot = parts[k][picks].mean(1) / gap
        boot = boot[np.isfinite(boot)]
        lo, hi = (float(x) for x in np.percentile(boot, [2.5, 97.5])) if boot.size else (None, None)
        out[f"{k}_share"] = {"mean": point, "lo": lo, "hi": hi}
    out["seeds"] = seeds
    return out


def trend(by_scale: dict[str, dict[str, dict[int, float]]], arm: str) -> dict[str, Any]:
    """Per seed, the least-squares slope of (agent - arm) against log10(1/c) over the
    scales that seed has, then its mean and t interval over seeds: does the gap grow as
    the Verifier's scale shrinks?"""
    x = {c: float(np.log10(1 / float(c))) for c in SCALES}
    slopes = []
    for seed in SEEDS:
        pts = [
            (x[c], v["agent"][seed] - v[arm][seed])
            for c, v in by_scale.items()
            if seed in v.get("agent", {}) and seed in v.get(arm, {})
        ]
        if len(pts) >= 3:
            xs, ys = np.array(pts).T
            slopes.append(float(np.polyfit(xs, ys, 1)[0]))
    return {**significant(mean_ci(slopes)), "per": "decade of 1/c"}


def predictions(probe_dir: Path) -> dict[str, Any]:
    """Per scale, from the probe run before the study: each agent's predicted factor F_k
    under each baseline and its advantage offset (mean) and spread (sd)."""
    found: dict[str, Any] = {}
    for c in SCALES:
        path = probe_dir / f"dose_c{c}.json"
        if not path.is_file():
            continue
        probe = json.loads(path.read_text())
        found[c] = {
            agent: {
                b: {
                    "F": r["predicted_factor"],
                    "offset": probe["offsets"][agent][b]["mean"],
                    "sd": probe["offsets"][agent][b]["sd"],
                    "offset_share": probe["offsets"][agent][b]["offset_share"],
                }
                for b, r in rows.items()
            }
            for agent, rows in probe["agents"].items()
        }
        found[c]["commit"] = probe.get("commit")
    return found


def summarize(out: Path, write: bool = True) -> dict[str, Any]:
    by_scale = {c: finals(out, g) for c, g in zip(SCALES, PLAN)}
    summary: dict[str, Any] = {"arms": {}, "contrasts": {}, "factorial": {}, "trend": {}}
    for c, values in by_scale.items():
        summary["arms"][c] = {
            m: {**mean_ci(list(v.values())), "seeds": sorted(v)} for m, v in values.items()
        }
        for arm in ("step_global", "global", *ABLATIONS):
            if "agent" in values and arm in values:
                summary["contrasts"][f"c={c}: agent - {arm}"] = paired(values["agent"], values[arm])
        if c in ABLATED:
            summary["factorial"][c] = factorial(values)
    _holm(summary["contrasts"], by_scale)
    for arm in ("step_global", "global"):
        summary["trend"][f"agent - {arm}"] = trend(by_scale, arm)
    summary["predictions"] = predictions(out / "probe")
    summary["state"] = git_state(REPO)
    if write:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        (out / "summary.md").write_text(markdown(summary))
    return summary


def _holm(contrasts: dict[str, dict[str, Any]], by_scale: dict[str, Any]) -> None:
    """Each contrast's paired t-test p and its Holm adjustment over all of the study's
    contrasts (the family: every scale, every arm against `agent`)."""
    tested = {}
    for key, c in contrasts.items():
        scale, arm = key[len("c=") :].split(": agent - ")
        values = by_scale[scale]
        if len(c["seeds"]) >= 2:
            diffs = [values["agent"][s] - values[arm][s] for s in c["seeds"]]
            tested[key] = paired_p(diffs)
    for key, adjusted in zip(tested, holm(list(tested.values()))):
        contrasts[key].update(p=tested[key], p_holm=adjusted, significant_holm=adjusted < 0.05)


def _ci(c: dict[str, Any]) -> str:
    if c.get("mean") is None:
        return "no runs"
    if c.get("lo") is None:
        return f"{c['mean']:+.3f} (n = {c.get('n', 1)})"
    sig = "" if "significant" not in c else ("; significant" if c["significant"] else "; n.s.")
    n = f"n = {c['n']}" if "n" in c else "bootstrap"
    return f"{c['mean']:+.3f} [{c['lo']:+.3f}, {c['hi']:+.3f}] ({n}{sig})"


def markdown(s: dict[str, Any]) -> str:
    lines = ["| c | arm | held-out avg@8 [95 % CI] | seeds |", "|---|---|---|---|"]
    for c, arms in s["arms"].items():
        for arm, v in arms.items():
            lines.append(f"| {c} | {arm} | {_ci(v).replace('+', '')} | {len(v['seeds'])} |")
    lines += [
        "",
        "| paired contrast | mean [95 % CI] | p | p, Holm over all |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {_ci(v)} | {v.get('p', float('nan')):.4f} | {v.get('p_holm', float('nan')):.4f} |"
        for k, v in s["contrasts"].items()
    ]
    for c, f in s["factorial"].items():
        if "gap" not in f:
            continue
        lines += ["", f"2 x 2 at c = {c} (seeds {f['seeds']}):", ""]
        lines += [f"- {k}: {_ci(f[k])}" for k in ("gap", "offset", "scale", "interaction")]
        lines += [f"- {k} share of the gap: {_ci(f[f'{k}_share'])}" for k in ("offset", "scale")]
    lines += ["", "Trend of each gap per decade of 1/c (per-seed slope, t interval):", ""]
    lines += [f"- {k}: {_ci(v)}" for k, v in s["trend"].items()]
    for c, agents in s["predictions"].items():
        lines += ["", f"Probe at c = {c} (before the runs; commit {agents.get('commit')}):", ""]
        for agent, rows in agents.items():
            if agent == "commit":
                continue
            cells = ", ".join(
                f"{b} F {r['F']:.2f} offset {r['offset']:+.2f} sd {r['sd']:.2f}"
                for b, r in rows.items()
            )
            lines.append(f"- {agent}: {cells}")
    return "\n".join(lines) + "\n"


def main() -> int:
    def missing(out: Path, _groups: list[Group]) -> str:
        if (out / "probe").is_dir():
            return ""
        return f"no predictions in {out / 'probe'}: run probe_teams.py first (see --help)"

    return study_main(
        __doc__ or "", PLAN, OUT, summarize, "benchmarks/studies/study_dose.py",
        minutes=lambda _group, _mode: 3.5, missing=missing,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
