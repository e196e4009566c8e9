"""Role rewards of the built-in teams (workflow.rewards=role) on scripted episodes.

Every case runs one scripted episode in both modes. Under `team` no step carries a reward
(each is scored with the episode's team reward, as before); under `role` every step carries
its own, and the expected values below are worked out by hand from the team docstrings'
definitions (drmas/teams/math/workflow.py, drmas/teams/search/workflow.py). In both modes
the episode reward, the actions' validity and the metrics are the same: role rewards only
change what each step is paid.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, cast

import pytest

from drmas.actors.engines.base import Engine
from drmas.config import ConfigError, load_config
from drmas.config.actor import WorkflowConfig
from drmas.config.types import RewardKind
from drmas.protocol.messages import Episode, SamplingParams, Task, pack_group
from drmas.protocol.validate import Limits, check_group_result
from drmas.teams.math.workflow import MathTeam, verdict_reward
from drmas.teams.resolve import resolve_team
from drmas.teams.search.qa import contains_answer
from drmas.teams.search.workflow import RetrieverTool, SearchTeam
from tests.fixtures.engines import CharTokenizer, Reply, ScriptedEngine
from tests.fixtures.retriever import Doc, FakeRetriever

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=32)

YES, NO = " <verify>yes</verify>", " <verify>no</verify>"


def _both_modes(run: Any) -> tuple[Episode, Episode]:
    """The same script under team and role rewards; what must not differ between them."""
    team, role = run("team"), run("role")
    assert team.reward == role.reward
    assert [(s.agent, s.valid) for s in team.steps] == [(s.agent, s.valid) for s in role.steps]
    assert team.metrics == role.metrics
    assert [s.reward for s in team.steps] == [None] * len(team.steps)
    assert all(s.reward is not None for s in role.steps)  # None would mean the team reward
    return team, role


# ---------------------------------------------------------------------------- math
MATH_TASK = Task(task_id="arithmetic:train:0", question="2+3", answer="5", source="arithmetic")


def _math_agent(prompt: str) -> str:
    return "verifier" if prompt.endswith("Verifier:") else "solver"


def _script(replies: Mapping[str, Sequence[str]]) -> dict[str, list[Reply]]:
    return {agent: list(texts) for agent, texts in replies.items()}


def _math(script: Mapping[str, Sequence[str]], max_loops: int = 2) -> Any:
    def run(mode: RewardKind) -> Episode:
        tok = CharTokenizer()
        engine = ScriptedEngine(_script(script), tok, _math_agent)
        team = MathTeam(
            WorkflowConfig(max_loops=max_loops, rewards=mode),
            {"solver": "m", "verifier": "m"},
            cast(dict[str, Engine], {"m": engine}),
            {"m": tok},
        )
        return asyncio.run(team.run_episode(MATH_TASK, SAMPLING))

    return run


R, W = " \\boxed{5}", " \\boxed{4}"  # right and wrong answers to 2+3


@pytest.mark.parametrize(
    ("solver", "verifier", "max_loops", "team_reward", "role_rewards"),
    [
        # right answer, approved: both did their job
        ([R], [YES], 2, 1.0, [1.0, 1.0]),
        # wrong answer approved: the Solver earns 0, the Verifier's yes is wrong
        ([W], [YES], 2, 0.0, [0.0, 0.0]),
        # wrong, rightly rejected, then right: every step earns 1
        ([W, R], [NO], 2, 1.0, [0.0, 1.0, 1.0]),
        # right, wrongly rejected, then wrong: the first answer is still paid, the team is not
        ([R, W], [NO], 2, 0.0, [1.0, 0.0, 0.0]),
        # an unparseable answer is not right, so rejecting it is the right verdict
        ([" five", R], [NO], 2, 1.0, [0.0, 1.0, 1.0]),
        # a reply without a verdict is routed as a rejection but earns nothing, even where
        # "no" would have been right
        ([W, R], [" looks fine"], 2, 1.0, [0.0, 0.0, 1.0]),
        # three loops, two rejections of wrong answers, then a right one
        ([W, " \\boxed{6}", R], [NO, NO], 3, 1.0, [0.0, 1.0, 0.0, 1.0, 1.0]),
        # one loop: the Solver alone
        ([R], [], 1, 1.0, [1.0]),
    ],
)
def test_math_role_rewards(
    solver: list[str],
    verifier: list[str],
    max_loops: int,
    team_reward: float,
    role_rewards: list[float],
) -> None:
    team, role = _both_modes(_math({"solver": solver, "verifier": verifier}, max_loops))
    assert team.reward == team_reward
    assert [s.reward for s in role.steps] == role_rewards


def test_verdict_reward_table() -> None:
    assert verdict_reward(True, True) == 1.0
    assert verdict_reward(False, False) == 1.0
    assert verdict_reward(True, False) == 0.0
    assert verdict_reward(False, True) == 0.0
    assert verdict_reward(None, False) == 0.0
    assert verdict_reward(None, True) == 0.0


# -------------------------------------------------------------------------- search
SEARCH_TASK = Task(
    "kb:train:0", "In which country was Bo Taki born?", "Orsa", "kb", ["Orsa", "Orsa Land"]
)
SEARCH_AGENT_OF_LABEL = {"Verifier:": "verifier", "Search:": "searcher", "Answer:": "answerer"}


def _search_agent(prompt: str) -> str:
    """Whose turn a prompt ends on: its last label (plain) or its closing line (chat)."""
    for label, agent in SEARCH_AGENT_OF_LABEL.items():
        if prompt.endswith(label) or f"You are the {label[:-1]} agent. Respond now." in prompt:
            return agent
    raise AssertionError(f"no agent's turn in {prompt!r}")


class ChatCharTokenizer(CharTokenizer):
    """CharTokenizer with a chat template that writes each message as `<role>content`."""

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool, tokenize: bool
    ) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return self(text, add_special_tokens=False).input_ids


INDEX = {  # a two-hop question: Bo Taki -> Lumo (the bridge) -> Orsa (the answer)
    "Bo Taki": [Doc("Bo Taki", "Bo Taki was born in Lumo."), Doc("Bo Taki", "Bo Taki is a baker.")],
    "Lumo": [Doc("Lumo", "Lumo is a city in Orsa.")],
    "Orsaland": [Doc("Orsaland", "Orsaland is a bakery.")],  # "orsa" only inside a word
}


def _search(script: Mapping[str, Sequence[str]], **cfg: Any) -> Any:
    def run(mode: RewardKind) -> Episode:
        engine = ScriptedEngine(_script(script), ChatCharTokenizer(), _search_agent)
        wcfg = WorkflowConfig(name="search", rewards=mode, **cfg)
        team = SearchTeam(
            wcfg,
            {"verifier": "v", "searcher": "s", "answerer": "a"},
            cast(dict[str, Engine], {"v": engine, "s": engine, "a": engine}),
            {m: engine.tokenizer for m in ("v", "s", "a")},
            {"search": RetrieverTool(FakeRetriever(INDEX), wcfg.prompt_style)},
        )
        return asyncio.run(team.run_episode(SEARCH_TASK, SAMPLING))

    return run


def _q(query: str) -> str:
    return f" <search>{query}</search>"


def _a(answer: str) -> str:
    return f" <answer>{answer}</answer>"


@pytest.mark.parametrize(
    ("script", "cfg", "team_reward", "role_rewards"),
    [
        # V no (nothing retrieved: right), S "Bo Taki" (bridge only: 0), V no (right),
        # S "Lumo" (holds Orsa: 1), V yes (right now), A "the Orsa!" (exact match)
        (
            {
                "verifier": [NO, NO, YES],
                "searcher": [_q("Bo Taki"), _q("Lumo")],
                "answerer": [_a("the Orsa!")],
            },
            {},
            1.0,
            [1.0, 0.0, 1.0, 1.0, 1.0, 1.0],
        ),
        # V yes before anything was retrieved (wrong), A guesses a wrong answer
        ({"verifier": [YES], "answerer": [_a("Lumo")]}, {}, 0.0, [0.0, 0.0]),
        # S finds the answer at once, but V asks for more (wrong), the extra search finds
        # nothing new (0), and the forced answer on the last turn is right
        (
            {
                "verifier": [NO, NO],
                "searcher": [_q("Lumo"), _q("Bo Taki")],
                "answerer": [_a("Orsa")],
            },
            {"max_turns": 3},
            1.0,
            [1.0, 1.0, 0.0, 0.0, 1.0],
        ),
        # V without a verdict (0, routed as no), S without a query (0), V yes with nothing
        # retrieved (wrong), A right by a guess (paid: exact match is its job)
        (
            {
                "verifier": [" hmm", YES],
                "searcher": [" dunno"],
                "answerer": [_a("Orsa Land")],
            },
            {"max_turns": 3},
            1.0,
            [0.0, 0.0, 0.0, 1.0],
        ),
        # a query with no results and one whose passage has "orsa" only inside a word
        (
            {
                "verifier": [NO, NO],
                "searcher": [_q("nobody"), _q("Orsaland")],
                "answerer": [_a("Lumo")],
            },
            {"max_turns": 3},
            0.0,
            [1.0, 0.0, 1.0, 0.0, 0.0],
        ),
        # on_invalid=end: a reply without a verdict ends the episode unanswered
        ({"verifier": [" hmm"]}, {"on_invalid": "end"}, 0.0, [0.0]),
        # one turn: the Answer Agent alone
        ({"answerer": [_a("Orsa")]}, {"max_turns": 1}, 1.0, [1.0]),
        # chat style renders titles with the passages; the same rewards
        (
            {"verifier": [NO, YES], "searcher": [_q("Lumo")], "answerer": [_a("Orsa")]},
            {"prompt_style": "chat"},
            1.0,
            [1.0, 1.0, 1.0, 1.0],
        ),
    ],
)
def test_search_role_rewards(
    script: dict[str, list[str]],
    cfg: dict[str, Any],
    team_reward: float,
    role_rewards: list[float],
) -> None:
    team, role = _both_modes(_search(script, **cfg))
    assert team.reward == team_reward
    assert [s.reward for s in role.steps] == role_rewards


def test_contains_answer_matches_whole_normalised_words() -> None:
    golds = ["Orsa", "Orsa Land"]
    assert contains_answer("Lumo is a city in Orsa.", golds)
    assert contains_answer("[1] (Lumo) Lumo is a city in the ORSA LAND!", golds)
    assert not contains_answer("Orsaland is a bakery.", golds)
    assert not contains_answer("Bo Taki was born in Lumo.", golds)
    assert not contains_answer(None, golds)
    assert not contains_answer("", golds)
    assert not contains_answer("the a an", ["The"])  # a gold that normalises to nothing
    assert contains_answer("He was born in New York City.", ["new york"])


# ----------------------------------------------------------------- wire and config
def test_role_rewards_travel_the_wire_and_pass_the_gate() -> None:
    episode = _search({"verifier": [NO, YES], "searcher": [_q("Lumo")], "answerer": [_a("Orsa")]})(
        "role"
    )
    episodes = [episode, _search({"verifier": [YES], "answerer": [_a("Lumo")]})("role")]
    group = pack_group("actor-0", 1, 7, episodes)
    limits = Limits(
        agent_models={"verifier": "v", "searcher": "s", "answerer": "a"},
        vocab_sizes={"v": 256, "s": 256, "a": 256},
    )
    check_group_result(group, limits, 2)
    back = group.unpack()
    assert [[s.reward for s in e.steps] for e in back] == [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0]]
    assert [e.reward for e in back] == [1.0, 0.0]


@pytest.mark.parametrize("team", ["math", "search"])
def test_role_rewards_and_a_replaced_reward_are_refused(team: str) -> None:
    overrides = ["workflow.rewards=role"]
    if team == "search":
        overrides.append("experiment=search_tiny")
    cfg = load_config(overrides)
    assert resolve_team(cfg).name == team  # role alone is fine
    both = dataclasses.replace(
        cfg, workflow=dataclasses.replace(cfg.workflow, reward="my_rewards.py:reward")
    )
    with pytest.raises(ConfigError, match=r"workflow\.rewards=role .* workflow\.reward="):
        resolve_team(both)
    team_cls = MathTeam if team == "math" else SearchTeam
    with pytest.raises(ValueError, match=r"keep workflow\.rewards=team"):
        team_cls.check_settings(both.workflow)


def test_a_team_that_sets_no_step_reward_under_role_rewards_is_named_once_per_agent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """TieTeam (a plug-in team) pays only the episode: with workflow.rewards=role its steps
    fall back to the team reward, and the user is told so, once per agent, not per group."""
    from tests.fixtures.tie_team import TieTeam

    def team(mode: RewardKind) -> TieTeam:
        tok = CharTokenizer()
        engine = ScriptedEngine({"solver": [R] * 4, "verifier": [YES] * 4}, tok, _math_agent)
        return TieTeam(
            WorkflowConfig(rewards=mode),
            {"solver": "m", "verifier": "m"},
            cast(dict[str, Engine], {"m": engine}),
            {"m": tok},
        )

    with caplog.at_level("WARNING", logger="drmas.team"):
        asyncio.run(team("team").run_group(MATH_TASK, SAMPLING, 2))
        assert caplog.records == []  # team rewards: nothing to say
        role = team("role")
        for _ in range(2):
            episodes = asyncio.run(role.run_group(MATH_TASK, SAMPLING, 2))
    assert all(s.reward is None for e in episodes for s in e.steps)  # nothing was invented
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == 2, named
    assert "agent 'solver'" in named[0] and "agent 'verifier'" in named[1]
    assert all("tie_team team left Step.reward unset" in m for m in named)
