"""A team defined outside the package that pays each agent its own reward (Step.reward,
tests/fixtures/role_team.py) trains with `drmas train` on the builtin tiny models: the
broker accepts the per-step rewards, every step line's `reward/<agent>/mean` is the
agent's own pay (the Verifier's on its own scale, 2..3), transcripts show each step's own
reward, score and the Dr. MAS advantage over those scores (checked against an independent
reference), and `drmas eval` reports each agent's mean step reward beside the team's
success."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from drmas.teams.math.grading import grade
from drmas.teams.math.prompts import parse_boxed, parse_verdict
from tests.fixtures.advantage_reference import reference_advantages
from tests.fixtures.role_team import solver_pay, verifier_pay
from tests.integration.conftest import drmas, read_metrics, read_summary

pytestmark = pytest.mark.slow

PENALTY = 0.1
STEPS = 3


def test_a_team_outside_the_package_trains_on_its_per_step_rewards(
    tmp_path: Path, model_cache: Path
) -> None:
    run_dir = tmp_path / "run"
    out = drmas(
        "train", "workflow.target=tests.fixtures.role_team:RoleTeam", f"train.steps={STEPS}",
        "group_size=4", "batch_groups=2", "val.every=3", "val.num_tasks=8", "val.n=2",
        "val.k=2", "models.solver.warmstart.steps=60", "models.verifier.warmstart.steps=60",
        f"algorithm.invalid_action_penalty={PENALTY}", "run.samples_every=1",
        "run.samples_episodes=4", "broker.heartbeat_timeout_s=10", "weights.timeout_s=10",
        f"run.dir={run_dir}", f"run.cache_dir={model_cache}",
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = read_metrics(run_dir)
    train = [x for x in lines if "val/tasks" not in x]
    assert [x["step"] for x in train] == list(range(1, STEPS + 1))
    for line in train:
        # each agent's mean is its own pay: the Solver's 0..1, the Verifier's 2..3
        assert 0.0 <= line["reward/solver/mean"] <= 1.0
        assert 2.0 <= line["reward/verifier/mean"] <= 3.0
        assert 2.0 - PENALTY <= line["score/verifier/mean"] <= 3.0
        assert line["steps/solver"] == line["steps/verifier"] == 8  # 2 groups of 4, one call each
    val = [x for x in lines if "val/tasks" in x]
    assert val and all(0.0 <= x["val/avg@2"] <= 1.0 for x in val)  # success: the team's
    counters = read_summary(run_dir)["counters"]
    assert not any(key.startswith("refused/") for key in counters), counters

    records = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert records
    as_team_reads = team_text(run_dir)
    for record in records:
        _check_transcript(record, as_team_reads)

    out = drmas("eval", str(run_dir), "--k", "2", "--tasks", "4")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((run_dir / "eval.json").read_text())
    overall = report["overall"]
    assert 0.0 <= overall["reward/solver"] <= 1.0 and 2.0 <= overall["reward/verifier"] <= 3.0
    assert 0.0 <= overall["team_reward"] <= 1.0 and 0.0 <= overall["avg@2"] <= 1.0
    assert "mean step reward per agent: solver " in out.stdout


def team_text(run_dir: Path) -> Callable[[str, str], str]:
    """(model, transcript text) -> the text the team graded. A transcript shows every token
    the model wrote, special ones included (the tiny models can sample `<unk>`); the team
    reads the response decoded without them."""
    from transformers import AutoTokenizer

    models = yaml.safe_load((run_dir / "config.yaml").read_text())["models"]
    specials = {
        name: AutoTokenizer.from_pretrained(spec["path"]).all_special_tokens
        for name, spec in models.items()
    }

    def read(model: str, text: str) -> str:
        for token in specials[model]:
            text = text.replace(token, "")
        return text

    return read


def _check_transcript(record: dict, as_team_reads: Callable[[str, str], str]) -> None:
    """Every step's own reward follows the team's pay rules (re-graded here from its text,
    as the team read it), its score is that reward minus the penalty if invalid, and its
    advantage is Dr. MAS over the whole group's scores (samples_episodes = group_size: the
    record holds the group)."""
    episodes = record["episodes"]
    assert len(episodes) == record["group_episodes"] == 4
    for episode in episodes:
        solver, verifier = episode["steps"]
        assert (solver["agent"], verifier["agent"]) == ("solver", "verifier")
        answer = parse_boxed(as_team_reads(solver["model"], str(solver["response"])))
        right = grade(answer, record["answer"])
        assert solver["reward"] == solver_pay(answer, record["answer"])
        verdict = parse_verdict(as_team_reads(verifier["model"], str(verifier["response"])))
        assert verifier["reward"] == verifier_pay(verdict, right)
        assert episode["reward"] in (0.0, 1.0)
        for step in (solver, verifier):
            penalty = 0.0 if step["valid"] else PENALTY
            assert step["score"] == pytest.approx(step["reward"] - penalty)
    scores = [[(s["agent"], s["score"]) for s in e["steps"]] for e in episodes]
    (expected,) = reference_advantages([scores], "agent")
    got = [s["advantage"] for e in episodes for s in e["steps"]]
    assert got == pytest.approx([a for episode in expected for a in episode], rel=1e-9, abs=1e-9)
