"""The one start of a learner rank (drmas/learners/entry.py): where it takes its place in
the group from, and what it answers to a wrong invocation, before any torch import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from drmas.config import ConfigError, load_config, to_yaml
from drmas.learners.entry import group_place, set_rendezvous

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_alone_a_learner_is_rank_0_of_1(clean_env: pytest.MonkeyPatch) -> None:
    assert group_place(load_config([]), "solver") == (0, 1)


def test_torchrun_place_is_taken_when_it_matches_the_config(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert group_place(load_config(["models.solver.world_size=2"]), "solver") == (1, 2)


@pytest.mark.parametrize(
    ("env", "model", "message"),
    [
        ({}, "critic", r"--model 'critic' is not one of the run's models \['solver', 'verifier'\]"),
        ({"WORLD_SIZE": "2"}, "solver", r"torchrun --nproc-per-node 1 -m drmas\.learners"),
        ({"RANK": "1"}, "solver", r"RANK=1 is not in 0\.\.0"),
        ({"RANK": "one"}, "solver", "RANK='one' is not a whole number"),
    ],
)
def test_a_wrong_place_says_what_to_run(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], model: str, message: str
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        group_place(load_config([]), model)


def test_a_group_of_one_gets_a_free_port_on_loopback(clean_env: pytest.MonkeyPatch) -> None:
    set_rendezvous(load_config([]), "solver", 1)
    assert os.environ["MASTER_ADDR"] == "127.0.0.1"
    assert 1024 <= int(os.environ["MASTER_PORT"]) < 65536  # an unprivileged port


def test_rendezvous_set_by_the_launcher_or_config_wins(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("MASTER_ADDR", "10.0.0.2")
    clean_env.setenv("MASTER_PORT", "29511")
    set_rendezvous(load_config(["learner.master_port=29600"]), "solver", 2)
    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.2", "29511")
    clean_env.delenv("MASTER_PORT")
    set_rendezvous(load_config(["learner.master_port=29600"]), "solver", 2)
    assert os.environ["MASTER_PORT"] == "29600"


def test_several_ranks_without_a_rendezvous_are_refused(clean_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"torchrun --nproc-per-node 2 -m drmas\.learners"):
        set_rendezvous(load_config([]), "solver", 2)
    assert "MASTER_PORT" not in os.environ


def test_python_m_drmas_learners_answers_a_wrong_model_at_once(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(load_config([])))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-m", "drmas.learners", "--config", str(config), "--model", "critic"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert "python -m drmas.learners: --model 'critic' is not one of" in out.stderr
    assert "Traceback" not in out.stderr
