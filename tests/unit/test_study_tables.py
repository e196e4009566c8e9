"""The advantage-mode study's statistics and tables (benchmarks/studies/study_*.py), checked
against values worked out by hand, on synthetic runs and on the recorded ones."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the benchmarks package

from benchmarks.studies import study_stats, study_summary, study_tables  # noqa: E402

STUDY = ROOT / "benchmarks" / "results" / "study"


def test_t_quantiles_are_the_textbook_ones() -> None:
    assert study_stats.t_quantile(4) == pytest.approx(2.776445, abs=1e-6)
    assert study_stats.t_quantile(2) == pytest.approx(4.302653, abs=1e-6)
    with pytest.raises(ValueError, match="at least 2 values"):
        study_stats.t_quantile(0)


def test_mean_ci_by_hand() -> None:
    c = study_stats.mean_ci([1.0, 2.0, 3.0])  # mean 2, sd 1, half 4.302653 / sqrt(3)
    assert c["mean"] == 2.0 and c["sd"] == 1.0
    assert c["lo"] == pytest.approx(2 - 2.484138, abs=1e-6)
    assert c["hi"] == pytest.approx(2 + 2.484138, abs=1e-6)
    assert study_stats.mean_ci([0.5]) == {"n": 1, "mean": 0.5, "sd": None, "lo": None, "hi": None}


def test_sign_test_four_wins_and_a_tie_is_p_0125() -> None:
    # the search team's Answer Agent: spikes per seed, agent vs global
    s = study_stats.sign_test([5, 2, 4, 1, 4], [2, 1, 1, 0, 4])
    assert (s["more"], s["fewer"], s["ties"]) == (4, 0, 1)
    assert s["p"] == pytest.approx(2 / 2**4)
    assert study_stats.sign_test([1, 1], [1, 1])["p"] == 1.0


def test_paired_p_and_holm_by_hand() -> None:
    # differences 1, 2, 3: t = 2 / (1 / sqrt 3) = 3.4641 with 2 df, two-sided p 0.0742
    assert study_stats.paired_p([1.0, 2.0, 3.0]) == pytest.approx(0.074180, abs=1e-5)
    # Holm over 0.01, 0.04, 0.03: 3 x 0.01, then max(0.03, 2 x 0.03), then max(0.06, 0.04)
    assert study_stats.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert study_stats.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    with pytest.raises(ValueError, match="at least 2"):
        study_stats.paired_p([1.0])


def test_ratio_relative_and_seeds_needed() -> None:
    r = study_stats.ratio_ci([2.0, 8.0], [1.0, 2.0])  # log ratios ln 2, ln 4
    assert r["mean"] == pytest.approx(2**1.5)
    rel = study_stats.relative({"mean": 0.02, "lo": -0.05, "hi": 0.09}, 0.5)
    assert rel == pytest.approx({"mean": 4.0, "lo": -10.0, "hi": 18.0})
    # t(n-1)/sqrt(n) < 1 first at n = 7 (2.447/2.646; n = 6 gives 2.571/2.449 > 1)
    assert study_stats.seeds_needed(1.0, 1.0) == 7


def _run(group: str, mode: str, seed: int, avg: float, spikes: int) -> dict:
    grad = {"max": 1.0 + spikes, "median": 0.5, "spikes": spikes, "skipped_nonfinite": 0}
    return {
        "name": f"{group}_{mode}_s{seed}", "group": group, "mode": mode, "seed": seed,
        "wall_s": 60.0, "validation": [{"step": 20, "val/avg@8": avg}],
        "final": {"val/avg@8": avg, "val/pass@8": 0.9}, "spikes": {"model solver": grad},
    }  # fmt: skip


def test_main_table_on_synthetic_runs() -> None:
    # agent 0.5/0.6/0.7, global 0.4/0.6/0.5: differences 0.1, 0, 0.2 -> mean 0.1, sd 0.1,
    # half-width 4.302653 * 0.1 / sqrt(3) = 0.248414; GRPO's mean 0.5 -> +20 % [-29.7, +69.7]
    results = [_run("g", "agent", s, a, 2) for s, a in enumerate((0.5, 0.6, 0.7))]
    results += [_run("g", "global", s, a, 1 if s else 2) for s, a in enumerate((0.4, 0.6, 0.5))]
    g = study_summary.summarize(results, {}, {})["groups"]["g"]
    rows = study_tables.main_table(g)
    assert rows[2] == "| Dr. MAS (`agent`) | 3 | 0.600 [0.352, 0.848] | 0.900 [0.900, 0.900] |"
    assert rows[4] == (
        "| **agent − global, paired** | 3 | **+0.100 [−0.148, +0.348]** | 0.000 [0.000, 0.000] |"
    )
    pair = g["paired"][0]["metrics"]["val/avg@8"]
    assert study_tables.pct_text(pair["relative_pct"]) == "+20.0 % [−29.7 %, +69.7 %]"
    signs = g["spikes_agent_vs_global"]["solver"]
    assert (signs["more"], signs["ties"]) == (2, 1)
    assert (
        study_tables.per_seed_line(g)
        == "per seed, agent/global avg@8: 0.500/0.400, 0.600/0.600, 0.700/0.500"
    )


def test_ablation_pairs_with_its_reference_group() -> None:
    results = [_run("m", mode, s, 0.5 + 0.1 * s, 0) for mode in ("agent", "global") for s in (0, 1)]
    results += [_run("abl", "agent_std", s, 0.55 + 0.1 * s, 3) for s in (0, 1)]
    g = study_summary.summarize(results, {"abl": "m"}, {})["groups"]["abl"]
    rows = study_tables.ablation_table(g)
    # differences +0.05 at both seeds: sd 0, the interval is the point; the mode's own
    # 0.55/0.65: sd 0.0707, half-width 12.7062 * 0.0707 / sqrt(2) = 0.635
    assert rows[2] == (
        "| `agent_std` | 2 | 0.600 [−0.035, 1.235] | +0.050 [+0.050, +0.050] "
        "| +0.050 [+0.050, +0.050] | 4.00 / 0.50 | 6 |"
    )
    assert g["reference_means"]["agent"]["val/avg@8"] == pytest.approx(0.55)


def test_recorded_search_pair_matches_an_independent_computation() -> None:
    """The recorded search runs: the summary's relative difference is the paired mean
    over GRPO's mean, from the unrounded finals (+3.49 %, not the +3.6 % of rounded means)."""
    finals = {
        (m, s): json.loads((STUDY / f"search_{m}_s{s}.json").read_text())["final"]["val/avg@8"]
        for m in ("agent", "global")
        for s in range(5)
    }
    diff = sum(finals[("agent", s)] - finals[("global", s)] for s in range(5)) / 5
    base = sum(finals[("global", s)] for s in range(5)) / 5
    results = study_summary.load_results(STUDY)
    g = study_summary.summarize([r for r in results if r["group"] == "search"], {}, {})
    pair = g["groups"]["search"]["paired"][0]["metrics"]["val/avg@8"]
    assert pair["relative_pct"]["mean"] == pytest.approx(100 * diff / base)
    assert round(pair["relative_pct"]["mean"], 2) == 3.49
    assert not math.isclose(pair["relative_pct"]["mean"], 3.6, abs_tol=0.05)


def test_provenance_git_state_and_relative_paths(tmp_path: Path) -> None:
    """A run records HEAD and whether the tree has changes outside benchmarks/results/
    (the study's own output), and the run's files name the repository's paths relative
    to it."""
    import subprocess

    from benchmarks.studies import study_advantage_modes as study

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    state = study.git_state(tmp_path)
    assert len(state["commit"]) == 40 and state["dirty"] is False
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "run.json").write_text("{}")
    assert study.git_state(tmp_path)["dirty"] is False  # the study's output does not count
    (tmp_path / "code.py").write_text("x = 2\n")
    assert study.git_state(tmp_path) | {"commit": None} == {
        "commit": None, "dirty": True, "dirty_paths": ["code.py"]
    }  # fmt: skip
    # results written into a folder that does not exist yet: the repository above it
    assert study.results_root(tmp_path / "not" / "yet").resolve() == tmp_path.resolve()
    assert study.relative(tmp_path / "a" / "b", tmp_path) == "a/b"
    assert study.relative(Path("/elsewhere/x"), tmp_path) == "/elsewhere/x"

    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"run:\n  dir: {tmp_path.resolve()}/runs/r\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    study.copy_run_files(run, tmp_path / "kept", (tmp_path,))
    assert (tmp_path / "kept" / "config.yaml").read_text() == "run:\n  dir: runs/r\n"
    assert (tmp_path / "kept" / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (tmp_path / "kept" / "train_summary.json").exists()


def test_the_page_shows_the_tables_the_script_writes() -> None:
    """Every row of docs/results.md's study tables is what the script writes from the
    recorded runs (and the probe's recorded JSONs). If this fails after new runs or a new
    probe measurement: python benchmarks/studies/study_advantage_modes.py --summarize, then copy
    the rows of study_summary.md into the page (--compare docs/results.md lists them)."""
    from benchmarks.studies import study_advantage_modes as study

    results = study_summary.load_results(STUDY)
    lines = {r["name"]: study.metrics_lines(STUDY, r["name"]) for r in results}
    refs = {g.name: g.reference for g in study.PLAN if g.reference}
    summary = study_summary.summarize(results, refs, lines)
    assert study.compare(ROOT / "docs" / "results.md", summary) == []


def test_the_lemma_summary_recomputes_from_the_recorded_runs(tmp_path: Path) -> None:
    from benchmarks.studies import study_lemma

    recorded = json.loads((STUDY / "lemma" / "summary.json").read_text())
    fresh = study_lemma.summarize(STUDY / "lemma", write=False)
    for name, c in recorded["contrasts"].items():
        assert fresh["contrasts"][name]["mean"] == pytest.approx(c["mean"], abs=1e-12), name
        assert fresh["contrasts"][name]["significant"] == c["significant"], name
    # the primary contrast by hand, seed by seed from the run records
    diffs = [
        json.loads((STUDY / "lemma" / f"lemma_scaled_{m}_s{s}.json").read_text())["final"]["val/avg@8"]
        * (1 if m == "agent" else -1)
        for s in range(8)
        for m in ("agent", "step_global")
    ]  # fmt: skip
    assert fresh["contrasts"]["lemma_scaled: agent - step_global"]["mean"] == pytest.approx(
        sum(diffs) / 8
    )


def test_the_lemma_mechanism_averages_each_runs_first_and_last_quarter(tmp_path: Path) -> None:
    from benchmarks.studies import study_lemma

    group = study_lemma.PLAN[0]
    for seed, offset in ((0, 0.0), (1, 1.0)):
        run = tmp_path / "run_files" / f"{group.name}_agent_s{seed}"
        run.mkdir(parents=True)
        rows = [{"step": 0, "val/avg@8": 0.5}]  # a validation row: not a training step
        rows += [
            {"step": i + 1, "advantage/verifier/mean": i + offset, "steps/verifier": 64}
            for i in range(8)
        ]  # fmt: skip
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    m = study_lemma.mechanism(tmp_path, group)["agent"]
    # quarters of 8 steps are 2: seed 0 first (0+1)/2, last (6+7)/2; seed 1 one more
    assert m["advantage/verifier/mean"] == {"first": 1.0, "last": 7.0}
    assert m["steps/verifier"] == {"first": 64.0, "last": 64.0}


def test_the_lemma_dry_run_counts_the_step0_round_in_each_seeds_first_mode() -> None:
    from benchmarks.studies import study_lemma

    smol = next(g for g in study_lemma.PLAN if g.name == "lemma_smol")
    assert smol.step0_minutes > 0
    assert study_lemma.run_minutes(smol, smol.modes[0]) == smol.minutes + smol.step0_minutes
    assert study_lemma.run_minutes(smol, smol.modes[1]) == smol.minutes


def test_the_lemma_runner_restricts_to_the_arms_asked_for_and_names_a_wrong_one(
    tmp_path: Path,
) -> None:
    from benchmarks.studies import study_lemma

    smol = [g for g in study_lemma.PLAN if g.name == "lemma_smol"]
    (tmp_path / "lemma_smol_step_global_s0.json").write_text("{}")  # done before: skipped
    left = study_lemma.runs_left(tmp_path, smol, [0, 1], ["step_global"])
    assert [name for name, *_ in left] == ["lemma_smol_step_global_s1"]
    assert len(study_lemma.runs_left(tmp_path, smol, [0, 1], None)) == 3
    with pytest.raises(ValueError, match="--modes global: not an arm of lemma_smol"):
        study_lemma.runs_left(tmp_path, smol, None, ["global"])


def test_both_studies_share_one_command_line_and_the_dose_study_wants_its_probe_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """study_lemma.py and study_dose.py parse the same options (study_main): a dry run
    lists the runs left with their minutes; the dose study refuses to run without the
    probe's predictions in <out>/probe, before it looks at the tree."""
    from benchmarks.studies import study_dose, study_lemma

    argv = ["study_lemma.py", "--dry-run", "--only", "lemma_smol_half", "--seeds", "0",
            "--out", str(tmp_path / "lemma")]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    assert study_lemma.main() == 0
    out = capsys.readouterr().out
    assert "lemma_smol_half_agent_s0  (about 80 min" in out and "2 runs, about 2.3 h" in out
    monkeypatch.setattr("sys.argv", ["study_dose.py", "--dry-run", "--out", str(tmp_path / "dose")])
    assert study_dose.main() == 0
    assert "(about 4 min with its models cached)" in capsys.readouterr().out
    monkeypatch.setattr(
        "sys.argv", ["study_dose.py", "--seeds", "0", "--out", str(tmp_path / "dose")]
    )
    with pytest.raises(SystemExit):
        study_dose.main()
    assert "run probe_teams.py first" in capsys.readouterr().err


def test_the_smol_half_runs_wait_for_their_probe(tmp_path: Path) -> None:
    """lemma_smol_half's runs are refused until its probe is recorded (the prediction is
    written down before training); the other groups need none."""
    from benchmarks.studies import study_lemma

    plan = {g.name: g for g in study_lemma.PLAN}
    half, smol = plan["lemma_smol_half"], plan["lemma_smol"]
    assert study_lemma.probe_missing(tmp_path, [smol], tmp_path) == ""
    why = study_lemma.probe_missing(tmp_path, [smol, half], tmp_path)
    assert "probe_teams.py --only smol_half_role_scaled first" in why
    (tmp_path / "smol_half_role_scaled.json").write_text("{}")
    assert study_lemma.probe_missing(tmp_path, [half], tmp_path) == ""


def test_provenance_counts_untracked_code_and_answers_outside_git(tmp_path: Path) -> None:
    """Every benchmark records provenance.git_state(): a new untracked source file makes the
    tree dirty (it may be the code that ran), a folder that is no checkout gives None
    rather than a made-up commit."""
    import subprocess

    from benchmarks import provenance

    assert provenance.git_state(tmp_path) == {"commit": None, "dirty": None, "dirty_paths": []}
    subprocess.run(["git", "-C", str(tmp_path), "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "a.py"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "one"], check=True)  # fmt: skip
    assert provenance.git_state(tmp_path)["dirty"] is False
    (tmp_path / "new_module.py").write_text("y = 2\n")
    state = provenance.git_state(tmp_path)
    assert state["dirty"] is True and state["dirty_paths"] == ["new_module.py"]


def test_the_dose_studys_two_by_two_splits_the_gap_into_offset_and_scale_by_hand() -> None:
    """Three seeds: step_global 0.5; agent_centred (offset removed) +0.09 over it;
    agent_shifted (rescaling removed) +0.01; agent +0.10, so no interaction. Offset effect
    per seed: ((a - shifted) + (centred - sg)) / 2 = (0.09 + 0.09) / 2 = 0.09, rescaling
    ((a - centred) + (shifted - sg)) / 2 = 0.01; they add up to the gap 0.10, shares 0.9
    and 0.1 in every resample."""
    from benchmarks.studies.study_dose import factorial, trend

    sg = {0: 0.50, 1: 0.40, 2: 0.60}
    values = {
        "step_global": sg,
        "agent_centred": {s: v + 0.09 for s, v in sg.items()},
        "agent_shifted": {s: v + 0.01 for s, v in sg.items()},
        "agent": {s: v + 0.10 for s, v in sg.items()},
    }
    f = factorial(values)
    assert f["seeds"] == [0, 1, 2]
    assert f["gap"]["mean"] == pytest.approx(0.10)
    assert f["offset"]["mean"] == pytest.approx(0.09) and f["scale"]["mean"] == pytest.approx(0.01)
    assert f["interaction"]["mean"] == pytest.approx(0.0, abs=1e-12)
    assert f["offset_share"]["mean"] == pytest.approx(0.9)
    assert f["offset_share"]["lo"] == pytest.approx(0.9) and f["offset_share"][
        "hi"
    ] == pytest.approx(0.9)
    assert f["scale_share"]["mean"] == pytest.approx(0.1)
    # one arm short of a pair: no split
    assert factorial({**values, "agent_shifted": {0: 0.5}}) == {"seeds": [0]}
    # a gap that grows by 0.05 a decade of 1/c in every seed (c = 1, 0.1: two points are
    # not a slope; 0.3 adds the third)
    gaps = {"1": 0.0, "0.3": 0.05 * math.log10(1 / 0.3), "0.1": 0.05}
    by_scale = {
        c: {"agent": {s: 0.5 + g for s in range(3)}, "step_global": {s: 0.5 for s in range(3)}}
        for c, g in gaps.items()
    }
    t = trend(by_scale, "step_global")
    assert t["n"] == 3 and t["mean"] == pytest.approx(0.05)
