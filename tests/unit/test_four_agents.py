"""The four-agent fixture team (tests/fixtures/four_agents.py) on a scripted engine: turn
order, what each agent reads, validity, the finisher's answer as the reward, and the
adapter each call names (its agent's on a LoRA base, shared by name; none otherwise)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, cast

from drmas.config import DrmasConfig, load_config
from drmas.protocol.engine import Engine
from drmas.protocol.messages import Episode, SamplingParams, Task
from drmas.teams.resolve import team_class
from tests.fixtures.engines import CharTokenizer, ScriptedEngine
from tests.fixtures.four_agents import FourAgents

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=32)
TASK = Task("t:0", "3+4", "7", "arithmetic")


def agent_of(prompt: str) -> str:
    """Plain prompts: instruction, question, one line per earlier turn, the label: the
    n-th agent reads n earlier turns."""
    return FourAgents.agents[len(prompt.splitlines()) - 3]


def config(tmp_path: Path, *overrides: str) -> DrmasConfig:
    """The team bound to one model `base`, as a user's --config file declares it."""
    file = tmp_path / "four.yaml"
    file.write_text(
        "workflow: {target: 'tests.fixtures.four_agents:FourAgents'}\n"
        "models: {base: {path: builtin:tiny-qwen2}}\n"
        "agents: {proposer: {model: base}, checker: {model: base}, critic: {model: base},"
        " finisher: {model: base}}\n"
    )
    return load_config(list(overrides), str(file))


def episode(cfg: DrmasConfig, script: dict[str, list[Any]]) -> tuple[Episode, ScriptedEngine]:
    engine = ScriptedEngine(script, CharTokenizer(), agent_of, model_name="base")
    engines = cast(dict[str, Engine], {"base": engine})
    agent_models = {a: cfg.model_of(a) for a in cfg.agents}
    team = team_class(cfg.workflow).build(cfg, agent_models, engines, {"base": engine.tokenizer})
    return asyncio.run(team.run_episode(TASK, SAMPLING)), engine


def test_each_agent_calls_with_its_own_adapter_and_the_finisher_answers(tmp_path: Path) -> None:
    cfg = config(
        tmp_path,
        "models.base.lora.rank=4",
        "agents.checker.adapter=reviewer",
        "agents.critic.adapter=reviewer",
    )
    script = {
        "proposer": [" \\boxed{5}"],
        "checker": [" <verify>no</verify>"],
        "critic": [" <verify>yes</verify>"],
        "finisher": [" \\boxed{7}"],
    }
    done, engine = episode(cfg, script)
    assert [c.agent for c in engine.calls] == list(FourAgents.agents)
    assert [c.request.adapter for c in engine.calls] == [
        "proposer", "reviewer", "reviewer", "finisher"
    ]  # fmt: skip
    assert engine.calls[3].prompt == (
        "Solve.\nQuestion: 3+4\nSolver: \\boxed{5}\nVerifier: <verify>no</verify>\n"
        "Verifier: <verify>yes</verify>\nSolver:"
    )
    assert [s.agent for s in done.steps] == list(FourAgents.agents)
    assert all(s.valid for s in done.steps) and {s.model for s in done.steps} == {"base"}
    assert done.reward == 1.0  # the finisher's 7, not the proposer's 5
    assert done.metrics == {"proposer_right": 0.0, "approvals": 1.0}


def test_without_adapters_calls_name_none_and_an_unparsed_final_answer_scores_zero(
    tmp_path: Path,
) -> None:
    script = {
        "proposer": [" \\boxed{7}"],
        "checker": [" <verify>yes</verify>"],
        "critic": [" looks fine"],
        "finisher": [" seven"],
    }
    done, engine = episode(config(tmp_path), script)
    assert [c.request.adapter for c in engine.calls] == ["", "", "", ""]
    assert [s.valid for s in done.steps] == [True, True, False, False]
    assert done.reward == 0.0  # the proposer was right, but the team's answer is the finisher's
    assert done.metrics == {"proposer_right": 1.0, "approvals": 1.0}
