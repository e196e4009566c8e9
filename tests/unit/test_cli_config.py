"""The CLI explains itself: option docs in --help, `drmas config`, unknown keys refused
with the nearest ones (also with `+`), Literal choices checked everywhere, resume
overrides applied or refused, roles that need --config say so."""

from __future__ import annotations

from pathlib import Path

import pytest

from drmas.config import ConfigError, load_config, to_yaml
from drmas.launch.cli import main as cli
from drmas.launch.train import resumed_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_typo_is_refused_with_the_nearest_key(prefix: str) -> None:
    with pytest.raises(ConfigError, match=r"did you mean algorithm\.loss\.clip_low"):
        load_config([f"{prefix}algorithm.loss.clip_lo=0.1"])
    with pytest.raises(ConfigError, match=r"did you mean models\.solver\.lr\b"):
        load_config([f"{prefix}models.solver.lrr=1e-4"])


def test_free_names_and_groups_are_not_typos() -> None:
    cfg = load_config(["experiment=tiny_math_shared", "models.policy.lr=2e-5"])
    assert cfg.models["policy"].lr == 2e-5
    load_config(["probe.rewards={solver: [0, 1], verifier: [1, 0.5]}"])


def test_literal_choices_are_checked_in_every_pool() -> None:
    with pytest.raises(ConfigError, match=r"actor\.pools\.verifier\.name='vlm'"):
        load_config(["+actor.pools={verifier: {name: vlm}}"])
    with pytest.raises(ConfigError, match=r"actor\.pools\.verifier\.pause_mode='nope'"):
        load_config(["+actor.pools={verifier: {name: sim, pause_mode: nope}}"])


def test_help_lists_the_main_options_with_their_docs(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    out = capsys.readouterr().out
    assert "algorithm.advantage.mode" in out and "agent = Dr. MAS (default)" in out
    assert "train.steps" in out and "val.every" in out


def test_help_and_config_docs_list_every_mode_and_experiment(
    capsys: pytest.CaptureFixture,
) -> None:
    """Every advantage mode the schema accepts and every experiment under configs/ is
    named by `drmas train --help` and `drmas config --docs` (the help once left out
    step_global and smol_math, which it listed by hand)."""
    import re
    import typing

    from drmas.config.types import AdvantageMode

    modes = typing.get_args(AdvantageMode)
    experiments = sorted(p.stem for p in (ROOT / "configs" / "experiment").glob("*.yaml"))
    assert "step_global" in modes and "smol_math" in experiments
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    helped = " ".join(capsys.readouterr().out.split())  # the epilog is wrapped
    for name in [*modes, *experiments]:
        assert re.search(rf"\b{name}\b", helped), name
    assert cli(["config", "algorithm.advantage", "--docs"]) == 0
    line = next(
        x for x in capsys.readouterr().out.splitlines() if x.startswith("algorithm.advantage.mode")
    )
    assert line.endswith(f"One of: {', '.join(modes)}."), line
    assert cli(["config", "--docs"]) == 0  # the whole list starts with the config groups
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("# experiment=NAME") and all(
        re.search(rf"\b{name}\b", first) for name in experiments
    ), first


def test_drmas_config_prints_the_resolved_config(capsys: pytest.CaptureFixture) -> None:
    assert cli(["config", "algorithm.loss", "algorithm.loss.clip_low=0.1"]) == 0
    assert "clip_low: 0.1" in capsys.readouterr().out
    assert cli(["config", "val", "experiment=search_tiny", "--docs"]) == 0
    out = capsys.readouterr().out
    assert "val.n: 2  # Samples per task (one group of n episodes, at most 4096)." in out
    assert cli(["config", "algorithm.los"]) == 2
    assert "did you mean algorithm.loss" in capsys.readouterr().err


def _saved_run(tmp_path: Path, *overrides: str) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config([f"run.dir={run}", *overrides])
    (run / "config.yaml").write_text(to_yaml(cfg))
    return run


def test_resume_applies_the_command_lines_overrides_on_the_saved_config(tmp_path: Path) -> None:
    run = _saved_run(tmp_path, "train.steps=4", "group_size=4")
    args = [f"run.resume={run}", "train.steps=6"]
    cfg = resumed_config(load_config(args), args)
    assert (cfg.train.steps, cfg.group_size) == (6, 4)  # the override, and the run's own
    args = [f"run.resume={run}", "experiment=search_tiny"]
    with pytest.raises(ConfigError, match="cannot change when resuming"):
        resumed_config(load_config(args), args)


def test_a_role_without_config_says_which_flag_it_needs(capsys: pytest.CaptureFixture) -> None:
    assert cli(["actor", "broker.address=tcp://127.0.0.1:5555"]) == 2
    err = capsys.readouterr().err
    assert "--config RUN_DIR/config.yaml" in err and "Repo id" not in err


def test_the_command_table_matches_the_documented_commands() -> None:
    import drmas.launch.cli as cli_module

    names = [c.name for c in cli_module.COMMANDS]
    assert names == ["train", "prepare", "plan", "broker", "actor", "learner", "retriever", "probe",
                     "eval", "show", "config", "status", "keys", "data", "report"]  # fmt: skip
    documented = {line.split()[1] for line in (cli_module.__doc__ or "").splitlines()
                  if line.startswith("    drmas ")}  # fmt: skip
    assert documented == set(names)


def test_parsing_any_command_imports_no_torch() -> None:
    """`drmas --help` and the cheap commands stay instant: torch loads only once a
    command that needs it runs."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from drmas.launch.cli import _parser\n"
        "for argv in (['train', 'train.steps=1'], ['learner', '--model', 'm'], ['status', 'x'],"
        " ['eval', 'run'], ['report', 'r', '--out', 'o']):\n"
        "    _parser().parse_args(argv)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_learner_without_config_says_which_flag_it_needs(capsys: pytest.CaptureFixture) -> None:
    assert cli(["learner", "--model", "solver"]) == 2
    assert "drmas learner: models ['solver', 'verifier'] are builtin" in capsys.readouterr().err


def test_a_learner_for_a_model_the_run_lacks_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(load_config([])))
    assert cli(["learner", "--config", str(config), "--model", "critic"]) == 2
    assert (
        "drmas learner: --model 'critic' is not one of the run's models" in capsys.readouterr().err
    )
