"""`drmas probe` on each built-in team, into benchmarks/results/probe/ (what docs/results.md
and docs/probe.md show).

    python benchmarks/studies/probe_teams.py [--only tiny_math_sampled ...] [--out benchmarks/results/probe]

One `drmas probe` per case below, one at a time (each about 1-3 minutes on 2 cores with
the models cached), each into its own run folder; its probe.json is copied to
<out>/<case>.json with the command, the git commit and whether the tree had changes. A case
whose file exists is skipped: delete the file to measure it again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.provenance import git_state  # noqa: E402
from benchmarks.studies.variant_runs import run_drmas  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "probe"

SYNTHETIC = "probe.rewards={solver: [0, 3], verifier: [1, 0.3]}"
LEMMA = (
    "experiment=tiny_math_shared", "workflow.rewards=role", "algorithm.invalid_action_penalty=0",
    "probe.baselines=[global,step_global,agent_turn]",
)  # fmt: skip
CASES: dict[str, tuple[str, ...]] = {
    "tiny_math_synthetic": (SYNTHETIC,),
    "tiny_math_sampled": (),
    "tiny_math_shared_sampled": ("experiment=tiny_math_shared",),
    "tiny_math_role_sampled": ("workflow.rewards=role",),
    "search_tiny_sampled": ("experiment=search_tiny",),
    "search_tiny_role_sampled": ("experiment=search_tiny", "workflow.rewards=role"),
    "search_tiny_role_sampled_128g_seed1": (
        "experiment=search_tiny", "workflow.rewards=role", "probe.groups=128", "probe.seed=1",
    ),
    # the lemma study's design (benchmarks/studies/study_lemma.py): one shared model, role rewards,
    # no penalty, the Verifier's rewards scaled by 0.1 (and the unscaled control)
    "tiny_math_shared_role_scaled": (*LEMMA, "workflow.reward_scale.verifier=0.1"),
    "tiny_math_shared_role": LEMMA,
    # the dose-response (benchmarks/studies/study_dose.py): the Verifier paid c times its
    # reward, each baseline it compares, probed before any of its runs
    **{
        f"dose_c{c}": (*LEMMA[:3], "probe.baselines=[global,step_global,agent_centred,agent_shifted]",
                       f"workflow.reward_scale.verifier={c}")
        for c in ("1", "0.3", "0.1", "0.03")
    },
    # lemma_smol_half (study_lemma.py): SmolLM2-135M, one LoRA adapter shared by Solver and
    # Verifier, additions of 0..14, the Verifier paid x0.1; 32 groups (a SmolLM2 episode
    # costs about as much as a hundred of the tiny model's)
    "smol_half_role_scaled": (
        "experiment=smol_math", "workflow.rewards=role", "algorithm.invalid_action_penalty=0",
        "agents.verifier.adapter=solver", "task.ops=+", "task.max_operand=14", "task.num_val=128",
        "workflow.reward_scale.verifier=0.1", "probe.groups=32",
        "probe.baselines=[global,step_global,agent_centred,agent_shifted]",
    ),
}  # fmt: skip
"""Case -> the overrides of its `drmas probe` (64 groups, seed 0 unless they say)."""
HOURS = {"smol_half_role_scaled": 4.0}
"""A case's time limit where one hour is not enough: the SmolLM2 probe ran past an hour
on 2 loaded cores (sampling 256 episodes, then one backward pass per step)."""


def probe(case: str, out: Path) -> None:
    target = out / f"{case}.json"
    if target.is_file():
        print(f"{case}: recorded before, skipped", flush=True)
        return
    state = git_state()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"probe-{case}-") as tmp:
        args = [*CASES[case], f"run.dir={tmp}/run"]
        wall = run_drmas("probe", args, f"{case}: drmas probe", 3600 * HOURS.get(case, 1.0))
        result = json.loads((Path(tmp) / "run" / "probe.json").read_text())
        png = Path(tmp) / "run" / "probe.png"
        if png.is_file():
            shutil.copyfile(png, out / f"{case}.png")
    result["command"] = "drmas probe " + " ".join(repr(a) if " " in a else a for a in CASES[case])
    result.update(**state, probe_wall_s=wall)
    target.write_text(json.dumps(result, indent=2))
    print(f"{case}: {result['probe_wall_s']:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(CASES), help="cases (default: all)")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    for case in args.only or CASES:
        probe(case, Path(args.out))


if __name__ == "__main__":
    main()
