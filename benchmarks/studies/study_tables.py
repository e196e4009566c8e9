"""The tables (and the numbers the text quotes) of docs/results.md's study part, written
from study_summary.json (benchmarks/studies/study_summary.py) and the probe's recorded JSONs.

    summary ── main_table / ablation_table / one_seed_table / paper_table ──> markdown rows
    benchmarks/results/probe/*.json ── probe_table ──> markdown rows
    summary ── facts ──> bullet lines: paired sd, % of the baseline, seeds needed, the
                         paper's effect against the interval, spikes and sign tests, ...

Every table row the page shows is produced here, formatted as the page shows it, so
`study_advantage_modes.py --compare docs/results.md` can check the page line by line.
Numbers are rounded only when printed; percentages are computed from unrounded values.
"""

from __future__ import annotations

import json
import math
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.studies.study_stats import t_quantile  # noqa: E402

MINUS = "\u2212"

PAPER = {
    "math": ("+5.6 % avg@16, +4.6 % pass@16", 5.6),
    "search": ("+15.2 % avg@16, +13.1 % pass@16", 15.2),
}
"""The paper's Dr. MAS - GRPO (relative, its own benchmarks) for the same kind of team."""
PAPER_ABLATIONS = (
    "search 7B, avg@16: GRPO 28.0, agent mean only 39.1, agent σ only 42.9, Dr. MAS 43.8"
)
MODE_LABELS = {"agent": "Dr. MAS (`agent`)", "global": "GRPO (`global`)"}


def signed(x: float, digits: int = 3) -> str:
    """+0.005, −0.007 (a true minus sign), 0.000 without a sign when it rounds to 0."""
    text = f"{abs(x):.{digits}f}"
    if float(text) == 0:
        return text
    return ("+" if x > 0 else MINUS) + text


def plain(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}".replace("-", MINUS)


def ci_text(c: dict[str, Any], sign: bool = False, digits: int = 3) -> str:
    """mean [lo, hi]; `mean (1 seed)` without an interval; `-` without a value."""
    if c.get("mean") is None:
        return "-"
    fmt = signed if sign else plain
    if c.get("lo") is None:
        return f"{fmt(c['mean'], digits)} (1 seed)"
    return f"{fmt(c['mean'], digits)} [{fmt(c['lo'], digits)}, {fmt(c['hi'], digits)}]"


def pct_text(r: dict[str, Any]) -> str:
    """+3.5 % [−8.7 %, +15.8 %] (one decimal, from the unrounded difference)."""
    head = f"{signed(r['mean'], 1)} %"
    if r.get("lo") is None:
        return head
    return f"{head} [{signed(r['lo'], 1)} %, {signed(r['hi'], 1)} %]"


def norm_text(x: float) -> str:
    """A gradient norm: two decimals below 10, none above (590, not 590.53)."""
    return f"{x:.2f}" if x < 10 else f"{x:.0f}"


def _main_pair(g: dict[str, Any]) -> dict[str, Any] | None:
    return next((p for p in g["paired"] if (p["mode"], p["base"]) == ("agent", "global")), None)


def _keys(g: dict[str, Any]) -> list[str]:
    return list(g["step0_mean"]) or sorted(
        k for m in g["modes"].values() for k in m if k.startswith("val/")
    )


def main_table(g: dict[str, Any], note: str = "") -> list[str]:
    """Step 0, Dr. MAS, GRPO and the paired difference: mean [95 % t-interval] over
    seeds of each final held-out metric (`note` follows the first metric's name)."""
    keys = _keys(g)
    head = [k[4:] + (note if i == 0 else "") for i, k in enumerate(keys)]
    rows = ["| | seeds | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(keys)]
    if g["step0"]:
        cells = " | ".join(ci_text(g["step0_mean"][k]) for k in keys)
        rows.append(f"| step 0 (before RL) | {len(g['step0'])} | {cells} |")
    for mode in ("agent", "global"):
        if mode in g["modes"]:
            m = g["modes"][mode]
            cells = " | ".join(ci_text(m[k]) for k in keys)
            rows.append(f"| {MODE_LABELS[mode]} | {len(m['seeds'])} | {cells} |")
    pair = _main_pair(g)
    if pair:
        diffs = [ci_text(pair["metrics"][k], sign=True) for k in keys]
        diffs[0] = f"**{diffs[0]}**"
        rows.append(
            f"| **agent − global, paired** | {len(pair['seeds'])} | " + " | ".join(diffs) + " |"
        )
    return rows


def per_seed_line(g: dict[str, Any]) -> str:
    """per seed, agent/global avg@8: 0.748/0.737, ..."""
    pair = _main_pair(g)
    if not pair:
        return ""
    key = _keys(g)[0]
    values = ", ".join(f"{a:.3f}/{b:.3f}" for a, b in pair["metrics"][key]["per_seed"].values())
    return f"per seed, agent/global {key[4:]}: {values}"


def ablation_table(g: dict[str, Any], model: str = "solver") -> list[str]:
    """Each ablation's first metric, its paired differences with the reference group's
    agent and global runs of the same seeds, `model`'s gradient norms and spike steps."""
    key = _keys(g)[0]
    rows = [
        f"| mode | seeds | {key[4:]} | − agent, paired | − global, paired "
        f"| {model.capitalize()} max / median grad norm | spikes |",
        "|---|---|---|---|---|---|---|",
    ]
    pairs = {(p["mode"], p["base"]): p for p in g["paired"]}
    for mode, m in g["modes"].items():
        diffs = [
            ci_text(pairs[(mode, b)]["metrics"][key], sign=True) if (mode, b) in pairs else "-"
            for b in ("agent", "global")
        ]
        grad = m["grad"].get(model)
        norms = f"{norm_text(grad['max'])} / {norm_text(grad['median'])}" if grad else "-"
        spikes = sum(v["spikes"] for v in m["grad"].values())
        rows.append(
            f"| `{mode}` | {len(m['seeds'])} | {ci_text(m[key])} | {diffs[0]} | {diffs[1]} "
            f"| {norms} | {spikes} |"
        )
    return rows


def one_seed_table(summary: dict[str, Any], labels: dict[str, str]) -> list[str]:
    """The one-seed pairs (shared and heterogeneous teams): step 0, both modes and their
    difference in the first metric."""
    rows = ["| team | step 0 | Dr. MAS | GRPO | agent − global |", "|---|---|---|---|---|"]
    for group, label in labels.items():
        g = summary["groups"].get(group)
        if not g or not _main_pair(g):
            continue
        key = _keys(g)[0]
        step0 = g["step0_mean"][key]["mean"]
        a, b = (g["modes"][m][key]["mean"] for m in ("agent", "global"))
        diff = _main_pair(g)["metrics"][key]["mean"]  # type: ignore[index]
        s0 = "-" if step0 is None else f"{step0:.3f}"
        rows.append(f"| {label} | {s0} | {a:.3f} | {b:.3f} | {signed(diff)} |")
    return rows


def probe_table(probe_dir: Path, files: dict[str, str], mode: str = "global") -> list[str]:
    """Predicted factor F_k and measured ratio [bootstrap 95 %] under `mode`, per team
    (label -> JSON file in probe_dir; a missing file is left out) and agent."""
    rows = [f"| team | agent | F_k, {mode} | measured, {mode} |", "|---|---|---|---|"]
    for label, name in files.items():
        path = probe_dir / name
        if not path.is_file():
            continue
        agents = json.loads(path.read_text())["agents"]
        for i, (agent, modes) in enumerate(agents.items()):
            if mode not in modes:
                continue
            r = modes[mode]
            lo, hi = r["ci95"]
            measured = f"{r['measured_ratio']:.2f} [{lo:.2f}, {hi:.2f}]"
            team = f"| {label} |" if i == 0 else "| |"
            rows.append(f"{team} {agent} | {r['predicted_factor']:.2f} | {measured} |")
    return rows


def paper_table(summary: dict[str, Any], teams: dict[str, str]) -> list[str]:
    """The paper's relative differences beside ours (the paired difference over GRPO's
    mean), then spikes and ablations. `teams` maps a group to its row's label."""
    rows = [
        "| | paper (Qwen3, real benchmarks) | here (tiny models, synthetic tasks, 2 CPU cores) |",
        "|---|---|---|",
    ]
    groups = summary["groups"]
    for group, label in teams.items():
        pair = _main_pair(groups[group]) if group in groups else None
        if not pair:
            continue
        avg, pas = (pair["metrics"][k] for k in _keys(groups[group])[:2])
        verdict = "significant" if avg["significant"] else "not significant"
        here = (
            f"{pct_text(avg['relative_pct'])} {_keys(groups[group])[0][4:]}, "
            f"{signed(pas['relative_pct']['mean'], 1)} % {_keys(groups[group])[1][4:]}: {verdict}"
        )
        rows.append(f"| {label} | {PAPER.get(group, ('—', 0))[0]} | {here} |")
    counts = [
        f"{group} {_spikes(g, 'agent')} vs {_spikes(g, 'global')}"
        for group, g in groups.items()
        if group in teams and {"agent", "global"} <= set(g["modes"])
    ]
    signs = [
        (v["p"], group, model, v)
        for group in teams
        if group in groups
        for model, v in groups[group]["spikes_agent_vs_global"].items()
        if model != "all"
    ]
    if counts:
        text = "spike steps, Dr. MAS vs GRPO: " + ", ".join(counts)
        if signs:
            p, group, model, v = min(signs, key=lambda t: t[0])
            text += (
                f"; most one-sided: {group}'s {model}, more with Dr. MAS in {v['more']} of "
                f"{v['more'] + v['fewer'] + v['ties']} seeds ({v['ties']} tied), sign test p = {p:.3f}"
            )
        rows.append(f"| gradient spikes | largely removed by Dr. MAS | {text} |")
    abl = groups.get("math_ablation")
    if abl:
        rows.append(
            f"| ablations | {PAPER_ABLATIONS} | math ({_seed_count(abl)} seeds): {_ablation_verdict(abl)} |"
        )
    return rows


def _spikes(g: dict[str, Any], mode: str) -> int:
    return sum(v["spikes"] for v in g["modes"][mode]["grad"].values())


def _seed_count(g: dict[str, Any]) -> int:
    return max(len(m["seeds"]) for m in g["modes"].values())


def _ablation_verdict(g: dict[str, Any]) -> str:
    key = _keys(g)[0]
    hits = [f"`{p['mode']}` − {p['base']}" for p in g["paired"] if p["metrics"][key]["significant"]]
    text = "significant: " + ", ".join(hits) if hits else "no mode differs from `agent` or `global`"
    worst = max(
        ((mode, model, v) for mode, m in g["modes"].items() for model, v in m["grad"].items()),
        key=lambda t: max(t[2]["max_per_seed"]),
    )
    lo, hi = min(worst[2]["max_per_seed"]), max(worst[2]["max_per_seed"])
    return (
        f"{text}; `{worst[0]}` drives the {worst[1].capitalize()}'s pre-clip gradient norm to "
        f"{norm_text(lo)}–{norm_text(hi)} (median {norm_text(worst[2]['median'])})"
    )


def facts(group: str, g: dict[str, Any]) -> list[str]:
    """The numbers the page's text quotes for one group, as bullet lines."""
    out = []
    pair = _main_pair(g)
    if pair:
        out += _pair_facts(group, g, pair)
    for mode, m in g["modes"].items():
        for model, v in m["grad"].items():
            ratio = "/".join(f"{x:.0f}" for x in v["max_over_median_per_seed"])
            out.append(
                f"- {mode}, {model}: largest / median pre-clip grad norm {norm_text(v['max'])} / "
                f"{norm_text(v['median'])} (mean over seeds; per seed largest "
                f"{', '.join(norm_text(x) for x in v['max_per_seed'])}, {ratio}× its median); "
                f"spike steps {v['spikes']} (per seed {v['spikes_per_seed']}), "
                f"non-finite skipped {v['skipped_nonfinite']}"
            )
    for model, s in g["spikes_agent_vs_global"].items():
        out.append(
            f"- spike steps agent vs global, {model}: {sum(s['agent'])} vs {sum(s['global'])}; "
            f"agent more in {s['more']} of {s['more'] + s['fewer'] + s['ties']} seeds, fewer in "
            f"{s['fewer']}, tied in {s['ties']}: two-sided sign test p = {s['p']:.3f}"
        )
    invalid = {
        mode: [v.get("val/invalid_actions") for v in m["per_seed"].values()]
        for mode, m in g["modes"].items()
    }
    if any(x for v in invalid.values() for x in v if x is not None):
        out.append(
            "- final val/invalid_actions (invalid actions per held-out episode, a mean count, "
            "not a share of actions), per seed: "
            + "; ".join(
                f"{mode} " + ", ".join(f"{x:.3f}" for x in v if x is not None)
                for mode, v in invalid.items()
            )
        )
    if g["steps_per_batch"]:
        out.append(
            "- steps per batch (fewest–most over every run): "
            + ", ".join(f"{a} {lo:.0f}–{hi:.0f}" for a, (lo, hi) in g["steps_per_batch"].items())
        )
    for mode, ref in g["reference_means"].items():
        if len(ref) > 1:
            vals = ", ".join(f"{k[4:]} {v:.3f}" for k, v in ref.items() if k.startswith("val/"))
            out.append(f"- reference group's `{mode}` on seeds {ref['seeds']}: {vals}")
    out += _provenance_facts(g["provenance"])
    return out


def _pair_facts(group: str, g: dict[str, Any], pair: dict[str, Any]) -> list[str]:
    out = []
    n = len(pair["seeds"])
    for k, c in pair["metrics"].items():
        line = f"- agent − global {k[4:]}: {ci_text(c, sign=True)}"
        if c["sd"] is not None:
            line += f", per-seed sd {c['sd']:.3f}"
        if c["relative_pct"]:
            line += f"; {pct_text(c['relative_pct'])} of GRPO's mean {c['base_mean']:.3f}"
        if c["seeds_needed"] and not c["significant"]:
            line += f"; about {c['seeds_needed']} seeds for an interval this wide to exclude 0 at this mean"
        out.append(line)
    if n > 1:
        t = t_quantile(n - 1)
        out.append(
            f"- a 95 % interval over {n} paired seeds is ±{t:.3f}·sd/√{n} = "
            f"±{t / math.sqrt(n):.2f} sd of the per-seed difference"
        )
    first = pair["metrics"][_keys(g)[0]]
    if group in PAPER and first["lo"] is not None:
        effect = PAPER[group][1] / 100 * first["base_mean"]
        inside = first["lo"] <= effect <= first["hi"]
        out.append(
            f"- the paper's +{PAPER[group][1]} % is {signed(effect)} here ({PAPER[group][1]} % of "
            f"GRPO's mean): {'inside' if inside else 'outside'} the interval "
            f"[{signed(first['lo'])}, {signed(first['hi'])}]"
        )
    for model, r in pair["max_grad_ratio"].items():
        out.append(f"- agent / global largest pre-clip grad norm, {model}: {ci_text(r, digits=2)}×")
    return out


def _provenance_facts(p: dict[str, Any]) -> list[str]:
    out = [f"- commit {tag}: {len(names)} runs" for tag, names in p["commits"].items()]
    if p["not_recorded"]:
        out.append(f"- commit not recorded: {len(p['not_recorded'])} runs")
    if p["time_span_s"]:
        lo, hi = (datetime.fromtimestamp(t, timezone.utc) for t in p["time_span_s"])
        line = f"- metrics lines from {lo:%Y-%m-%d %H:%M} to {hi:%H:%M} UTC"
        if p.get("commits_in_span") is not None:
            n = p["commits_in_span"]
            line += f"; {n} commit{'' if n == 1 else 's'} touched drmas/ in that span (git log)"
        out.append(line)
    return out
