"""Plug-in teams: targets by module and by file, the `drmas.teams` registry, the agent
check, tool calls through `workflow.tools`, `workflow.reward`, and task sources by target."""

from __future__ import annotations

import asyncio
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import pytest

from drmas import plugins as loader
from drmas.actors.engines.base import Engine
from drmas.config import ConfigError, load_config
from drmas.config.actor import WorkflowConfig
from drmas.config.task import TaskConfig
from drmas.protocol.messages import Episode, SamplingParams, Task
from drmas.tasks.source import TaskFileError, TaskSource
from drmas.teams.base import Team
from drmas.teams.layout import TeamLayout
from drmas.teams.math import MathTeam
from drmas.teams.program import ProgramTeam
from drmas.teams.resolve import resolve, team_class, team_name
from drmas.teams.search import SearchTeam
from tests.fixtures.engines import CharTokenizer, ScriptedEngine

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=32)


CALLS: list[str] = []


async def calculator(argument: str) -> str:
    """A user tool: a plain async function."""
    CALLS.append(argument)
    a, b = argument.split("+")
    return str(int(a) + int(b))


def sync_tool(argument: str) -> str:
    return argument


def half_reward(task: Task, answer: str | None) -> float:
    return 0.5 if answer == task.answer else -0.5


class Asker(Team):
    """One agent that may call the calculator, then answers."""

    name = "asker"
    agents = ("asker",)
    layout = TeamLayout({"asker": "Asker", "calc": "Result"})
    default_instructions: ClassVar[dict[str, dict[str, str]]] = {"plain": {"asker": "Use calc."}}

    async def run_episode(self, task: Task, sampling: SamplingParams) -> Episode:
        turns: list[tuple[str, str]] = []
        used = await self.tool_step("asker", task, turns, sampling)
        text, answer_step = await self.call("asker", task, turns, sampling)
        answer_step.valid = True
        return Episode([used.step, answer_step], self.reward(task, text.strip()))

    def score(self, task: Task, answer: str | None) -> float:
        return float(answer == task.answer)


def asker_config(tmp_path: Path, *overrides: str) -> Any:
    """The Asker team bound to one tiny model, as a user's --config file declares it."""
    file = tmp_path / "asker.yaml"
    file.write_text(
        f"workflow: {{target: '{__name__}:Asker'}}\n"
        "models: {m: {path: builtin:tiny-qwen2}}\n"
        "agents: {asker: {model: m}}\n"
    )
    return load_config(list(overrides), str(file))


def run(team: Team, task: Task) -> Episode:
    return asyncio.run(team.run_episode(task, SAMPLING))


def test_targets_load_by_module_by_file_and_explain_what_is_missing(tmp_path: Path) -> None:
    assert loader.load_object("drmas.teams.math:MathTeam", "x") is MathTeam
    (tmp_path / "helper.py").write_text("VALUE = 41\n")
    (tmp_path / "mine.py").write_text("from helper import VALUE\nANSWER = VALUE + 1\n")
    assert loader.load_object(f"{tmp_path}/mine.py:ANSWER", "x") == 42  # imports its neighbour
    with pytest.raises(loader.TargetError, match=r"cannot import module 'no_such_pkg\.mod'"):
        loader.load_object("no_such_pkg.mod:Thing", "workflow.target")
    with pytest.raises(loader.TargetError, match=r"has no 'Nope'.*ANSWER"):
        loader.load_object(f"{tmp_path}/mine.py:Nope", "workflow.target")
    with pytest.raises(loader.TargetError, match="no file"):
        loader.load_object(f"{tmp_path}/absent.py:X", "workflow.target")
    with pytest.raises(loader.TargetError, match=r"expected package\.module:Name"):
        loader.load_object("just_a_name", "workflow.target")
    assert loader.absolute_target("team.py:T", tmp_path) == f"{tmp_path / 'team.py'}:T"
    assert loader.absolute_target("pkg.mod:T", tmp_path) == "pkg.mod:T"


def test_builtin_teams_are_registered_like_any_other(monkeypatch: pytest.MonkeyPatch) -> None:
    assert team_class(WorkflowConfig(name="math")) is MathTeam
    assert team_class(WorkflowConfig(name="search")) is SearchTeam
    assert team_class(WorkflowConfig(target="drmas.teams.math:MathTeam")) is MathTeam

    @dataclass
    class EntryPoint:
        name: str
        value: str

    def entry_points(group: str) -> list[EntryPoint]:
        assert group == "drmas.teams"
        return [EntryPoint("asker", f"{__name__}:Asker")]

    monkeypatch.setattr(loader, "entry_points", entry_points)
    assert team_class(WorkflowConfig(name="asker")) is Asker  # an installed package's team
    with pytest.raises(ConfigError, match=r"not a registered team \['asker', 'math', 'search'\]"):
        team_class(WorkflowConfig(name="askr"))
    with pytest.raises(
        ConfigError, match=r"neither a subclass of drmas\.teams\.Team nor a program"
    ):
        team_class(WorkflowConfig(target=f"{__name__}:sync_tool"))
    # an async function is a program (drmas/teams/program): the config's agents are its team
    program = team_class(WorkflowConfig(target=f"{__name__}:calculator"), ["a", "b"])
    assert issubclass(program, ProgramTeam) and program.agents == ("a", "b")


def test_config_names_both_agent_lists_and_checks_plugins(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"has agents \['asker'\].*names \['solver', 'verifier'\]"
    ):
        resolve(load_config([f"workflow.target={__name__}:Asker"]), "run")
    ok = asker_config(
        tmp_path,
        f"workflow.tools.calc={__name__}:calculator",
        f"workflow.reward={__name__}:half_reward",
    )
    assert resolve(ok, "run") is Asker and team_name(ok) == "asker"
    assert set(ok.agents) == {"asker"}
    with pytest.raises(ConfigError, match="must be an async function"):
        resolve(load_config([f"workflow.tools.calc={__name__}:sync_tool"]), "actor")
    with pytest.raises(ConfigError, match="cannot import module"):
        resolve(load_config(["workflow.reward=nowhere.rewards:exact"]), "actor")


def test_file_targets_in_a_config_file_resolve_against_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "team"
    folder.mkdir()
    (folder / "tasks.py").write_text(
        "def make(cfg):\n"
        "    items = [{'question': f'{i}+1', 'answer': i + 1} for i in range(6)]\n"
        "    return items[2:], items[:2]\n"
    )
    (folder / "config.yaml").write_text(
        textwrap.dedent(
            """
            task: {name: tasks.py:make}
            models:
              m: {path: builtin:tiny-qwen2, warmstart: {workflow: transcripts.py:SOURCE}}
              n: {path: builtin:tiny-qwen2, warmstart: {workflow: search}}
            agents: {solver: {model: m}, verifier: {model: n}}
            """
        )
    )
    cfg = load_config([], str(folder / "config.yaml"))
    assert cfg.task.name == f"{folder / 'tasks.py'}:make"
    # a warm start's transcripts from a file resolve the same way; a built-in name stays
    assert cfg.models["m"].warmstart.workflow == f"{folder / 'transcripts.py'}:SOURCE"
    assert cfg.models["n"].warmstart.workflow == "search"
    source = TaskSource(cfg.task)
    assert [t.task_id for t in source.val] == ["make:val:0", "make:val:1"]
    assert source.train[0] == Task("make:train:0", "2+1", "3", "make")
    # the same key on the command line is relative to the working directory
    with pytest.raises(ConfigError, match=f"no file {Path.cwd() / 'tasks.py'}"):
        resolve(load_config(["task.name=tasks.py:make"], str(folder / "config.yaml")), "broker")


def test_task_functions_get_clear_errors(tmp_path: Path) -> None:
    file = tmp_path / "bad.py"
    file.write_text(
        "def no_pair(cfg):\n    return [1, 2, 3]\n"
        "def no_answer(cfg):\n    return [{'question': 'q'}], []\n"
        "def twice(cfg):\n    item = {'id': 'x', 'question': 'q', 'answer': 'a'}\n"
        "    return [item], [item]\n"
        "def aliases(cfg):\n"
        "    return [{'question': 'q', 'answers': ['A', 'a'], 'source': 'mine'}], []\n"
    )
    with pytest.raises(TaskFileError, match="return \\(train, val\\)"):
        TaskSource(TaskConfig(name=f"{file}:no_pair"))
    with pytest.raises(TaskFileError, match="train item 0: needs a non-empty question and answer"):
        TaskSource(TaskConfig(name=f"{file}:no_answer"))
    with pytest.raises(ValueError, match="in both train and val"):
        TaskSource(TaskConfig(name=f"{file}:twice"))
    (task,) = TaskSource(TaskConfig(name=f"{file}:aliases")).train
    assert (task.answer, task.answers, task.source) == ("A", ["A", "a"], "mine")


def test_a_user_tool_is_called_and_its_result_joins_the_context(tmp_path: Path) -> None:
    cfg = asker_config(tmp_path, f"workflow.tools.calc={__name__}:calculator")
    engine = ScriptedEngine(
        [" <calc> 17 +\n 25 </calc>", " 42", " <calc></calc>", " 41"], CharTokenizer()
    )
    engines = cast(dict[str, Engine], {"m": engine})
    team = team_class(cfg.workflow).build(cfg, {"asker": "m"}, engines, {"m": engine.tokenizer})
    CALLS.clear()
    task = Task("t:0", "17+25", "42", "t")
    first = run(team, task)
    assert CALLS == ["17 + 25"]  # whitespace folded
    assert first.steps[0].valid and first.reward == 1.0
    assert engine.calls[1].prompt.endswith("Asker: <calc> 17 +\n 25 </calc>\nResult: 42\nAsker:")
    second = run(team, task)  # an empty call is an invalid step; no tool runs
    assert not second.steps[0].valid and CALLS == ["17 + 25"] and second.reward == 0.0


def test_workflow_reward_replaces_the_teams_score() -> None:
    engine = ScriptedEngine([" \\boxed{5}", " <verify>yes</verify>"] * 2, CharTokenizer())
    engines = cast(dict[str, Engine], {"m": engine})
    bind = {"solver": "m", "verifier": "m"}
    own = MathTeam(WorkflowConfig(), bind, engines, {"m": engine.tokenizer})
    replaced = MathTeam(
        WorkflowConfig(), bind, engines, {"m": engine.tokenizer}, reward=half_reward
    )
    task = Task("a:0", "2+3", "5", "a")
    assert run(own, task).reward == 1.0
    assert run(replaced, task).reward == 0.5

    def nan_reward(task: Task, answer: str | None) -> float:
        return float("nan")

    broken = MathTeam(WorkflowConfig(), bind, engines, {"m": engine.tokenizer}, reward=nan_reward)
    engine.calls.clear()
    with pytest.raises(ValueError, match=r"workflow\.reward returned nan"):
        run(broken, task)


def test_the_search_teams_retriever_is_one_replaceable_tool() -> None:
    cfg = load_config(["experiment=search_tiny", f"workflow.tools.search={__name__}:calculator"])
    tools = SearchTeam.make_tools(cfg)  # no index is built: the user's tool replaces it
    assert tools == {"search": calculator}
    assert cast(Any, SearchTeam.prepare(cfg)) is cfg
