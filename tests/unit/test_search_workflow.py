"""The search team's turn loop against a scripted engine and a fake retriever: routing
(Verifier yes/no, last-turn forcing), penalties (Step.valid), metrics, batching of a
group's searches, and the prompts each agent sees."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from drmas.actors.engines.base import Engine
from drmas.config.actor import WorkflowConfig
from drmas.protocol.messages import Episode, SamplingParams, Task
from drmas.teams.search.prompts import TINY_INSTRUCTIONS
from drmas.teams.search.workflow import RetrieverTool, SearchTeam
from tests.fixtures.engines import CharTokenizer, ScriptedEngine
from tests.fixtures.retriever import Doc, FakeRetriever

TASK = Task("kb:train:0", "In which country was Bo Taki born?", "Orsa", "kb", ["Orsa", "Orsa Land"])
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=32)
AGENT_OF_LABEL = {"Verifier:": "verifier", "Search:": "searcher", "Answer:": "answerer"}


def _agent(prompt: str) -> str:
    """Whose turn a prompt ends on, by the label it ends with."""
    return next(a for label, a in AGENT_OF_LABEL.items() if prompt.endswith(label))


INDEX = {
    "Bo Taki": [Doc("Bo Taki", "Bo Taki was born in Lumo."), Doc("Bo Taki", "Bo Taki is a baker.")],
    "Lumo": [Doc("Lumo", "Lumo is a city in Orsa.")],
}


def _workflow(
    script: dict[str, list[str]], **cfg: Any
) -> tuple[SearchTeam, ScriptedEngine, FakeRetriever]:
    engine, retriever = ScriptedEngine(dict(script), CharTokenizer(), _agent), FakeRetriever(INDEX)
    models = {"verifier": "v", "searcher": "s", "answerer": "a"}
    engines = cast(dict[str, Engine], {"v": engine, "s": engine, "a": engine})
    tokenizers: dict[str, object] = {m: engine.tokenizer for m in ("v", "s", "a")}
    wcfg = WorkflowConfig(name="search", **cfg)
    workflow = SearchTeam(
        wcfg, models, engines, tokenizers, {"search": RetrieverTool(retriever, wcfg.prompt_style)}
    )
    return workflow, engine, retriever


def _run(workflow: SearchTeam, task: Task = TASK) -> Episode:
    return asyncio.run(workflow.run_episode(task, SAMPLING))


def _trace(episode: Episode) -> list[tuple[str, bool]]:
    return [(s.agent, s.valid) for s in episode.steps]


# ------------------------------------------------------------------------- routing
def test_two_searches_then_the_verifier_approves_and_the_answer_is_exact() -> None:
    workflow, engine, retriever = _workflow(
        {
            "verifier": [" <verify>no</verify>", " <verify>no</verify>", " <verify>yes</verify>"],
            "searcher": [" <search>Bo Taki</search>", " <search> Lumo </search>"],
            "answerer": [" <answer>the Orsa!</answer>"],
        }
    )
    episode = _run(workflow)
    assert _trace(episode) == [
        ("verifier", True),
        ("searcher", True),
        ("verifier", True),
        ("searcher", True),
        ("verifier", True),
        ("answerer", True),
    ]
    assert retriever.queries == ["Bo Taki", "Lumo"]  # whitespace folded
    assert episode.reward == 1.0  # "the Orsa!" normalises to "orsa"
    assert episode.metrics == {
        "em": 1.0,
        "f1": 1.0,
        "answered": 1.0,
        "search_calls": 2.0,
        "turns": 3.0,
        "invalid_actions": 0.0,
    }
    # The Answer Agent saw the whole team context, passages included, in order.
    answer_prompt = engine.calls[-1].prompt
    assert answer_prompt == (
        f"{TINY_INSTRUCTIONS['answerer']}\nQuestion: {TASK.question}\n"
        "Verifier: <verify>no</verify>\n"
        "Search: <search>Bo Taki</search>\n"
        "Info: Bo Taki was born in Lumo. | Bo Taki is a baker.\n"
        "Verifier: <verify>no</verify>\n"
        "Search: <search> Lumo </search>\n"
        "Info: Lumo is a city in Orsa.\n"
        "Verifier: <verify>yes</verify>\n"
        "Answer:"
    )
    assert engine.calls[0].prompt.startswith(f"{TINY_INSTRUCTIONS['verifier']}\n")


def test_the_last_turn_forces_the_answer_without_asking_the_verifier() -> None:
    workflow, _, retriever = _workflow(
        {
            "verifier": [" <verify>no</verify>"] * 3,
            "searcher": [" <search>Bo Taki</search>"] * 3,
            "answerer": [" <answer>Lumo</answer>"],
        },
        max_turns=4,
    )
    episode = _run(workflow)
    agents = [a for a, _ in _trace(episode)]
    assert agents == ["verifier", "searcher"] * 3 + ["answerer"]
    assert len(retriever.queries) == 3
    assert episode.reward == 0.0  # Lumo is the city, not the country
    assert episode.metrics["turns"] == 4.0 and episode.metrics["answered"] == 1.0


def test_one_turn_is_the_answer_agent_alone() -> None:
    workflow, _, retriever = _workflow({"answerer": [" <answer>Orsa Land</answer>"]}, max_turns=1)
    episode = _run(workflow)
    assert _trace(episode) == [("answerer", True)]
    assert episode.reward == 1.0 and retriever.queries == []  # an alias counts


def test_verifier_yes_at_once_answers_without_searching() -> None:
    workflow, _, retriever = _workflow(
        {"verifier": [" <verify>yes</verify>"], "answerer": [" <answer>Orsa</answer>"]}
    )
    episode = _run(workflow)
    assert _trace(episode) == [("verifier", True), ("answerer", True)]
    assert retriever.queries == []
    assert episode.metrics["search_calls"] == 0.0 and episode.metrics["turns"] == 1.0


# ------------------------------------------------------------------ invalid actions
def test_invalid_actions_are_penalised_and_the_episode_continues() -> None:
    workflow, engine, retriever = _workflow(
        {
            "verifier": [" maybe?", " <verify>no</verify>"],
            "searcher": [" <search></search>", " <search>Lumo</search>"],
            "answerer": [" Orsa"],  # no <answer> tag
        },
        max_turns=3,
    )
    episode = _run(workflow)
    assert _trace(episode) == [
        ("verifier", False),  # no verdict: routed like "no"
        ("searcher", False),  # empty query: no retrieval
        ("verifier", True),
        ("searcher", True),
        ("answerer", False),
    ]
    assert retriever.queries == ["Lumo"]
    assert episode.reward == 0.0
    assert episode.metrics["invalid_actions"] == 3.0
    assert episode.metrics["answered"] == 0.0 and episode.metrics["f1"] == 0.0
    # the malformed replies stay in the context the next agents read
    assert "Verifier: maybe?\nSearch: <search></search>\nVerifier:" in engine.calls[2].prompt


def test_on_invalid_end_stops_the_episode_unanswered() -> None:
    workflow, _, retriever = _workflow(
        {"verifier": [" <verify>no</verify>"], "searcher": [" I would search for Bo"]},
        on_invalid="end",
    )
    episode = _run(workflow)
    assert _trace(episode) == [("verifier", True), ("searcher", False)]
    assert episode.reward == 0.0 and retriever.queries == []
    assert episode.metrics["answered"] == 0.0 and episode.metrics["turns"] == 1.0


def test_on_invalid_end_after_a_verifier_without_verdict() -> None:
    workflow, _, _ = _workflow({"verifier": [" <verify>perhaps</verify>"]}, on_invalid="end")
    assert _trace(_run(workflow)) == [("verifier", False)]


def test_f1_gives_partial_credit_where_exact_match_does_not() -> None:
    task = Task("kb:val:1", "What is Bo Taki's job?", "pastry baker", "kb")
    workflow, _, _ = _workflow(
        {"verifier": [" <verify>yes</verify>"], "answerer": [" <answer>baker</answer>"]}
    )
    episode = _run(workflow, task)
    assert episode.reward == 0.0
    assert episode.metrics["f1"] == pytest.approx(2 / 3)


# ------------------------------------------------------------------ groups and setup
def test_a_group_runs_its_episodes_concurrently() -> None:
    script = {
        "verifier": [" <verify>no</verify>", " <verify>yes</verify>"] * 4,
        "searcher": [" <search>Bo Taki</search>"] * 4,
        "answerer": [" <answer>Orsa</answer>"] * 4,
    }
    workflow, engine, retriever = _workflow(script)
    episodes = asyncio.run(workflow.run_group(TASK, SAMPLING, 4))
    assert len(episodes) == 4 and retriever.queries == ["Bo Taki"] * 4
    # the four first Verifier calls were all issued before any search: the engine and the
    # retriever each see the group's calls together
    assert [c.agent for c in engine.calls[:4]] == ["verifier"] * 4
    asyncio.run(workflow.close())
    assert retriever.closed


def test_bad_settings_and_bindings_are_refused() -> None:
    engine, retriever = ScriptedEngine({}, CharTokenizer(), _agent), FakeRetriever({})
    engines = cast(dict[str, Engine], {"m": engine})
    tok: dict[str, object] = {"m": engine.tokenizer}
    team = {"verifier": "m", "searcher": "m", "answerer": "m"}
    tools = {"search": RetrieverTool(retriever, "plain")}
    with pytest.raises(ValueError, match="max_turns"):
        SearchTeam(WorkflowConfig(max_turns=0), team, engines, tok, tools)
    with pytest.raises(ValueError, match="on_invalid"):
        SearchTeam(WorkflowConfig(on_invalid="retry"), team, engines, tok, tools)
    with pytest.raises(ValueError, match="agents"):
        SearchTeam(WorkflowConfig(), {"solver": "m"}, engines, tok, tools)
    with pytest.raises(ValueError, match="needs a 'search' tool"):
        SearchTeam(WorkflowConfig(), team, engines, tok, {})
