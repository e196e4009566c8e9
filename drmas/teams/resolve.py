"""Resolving a run's plug-ins: the team, its tools and reward, the task source.

load_config imports none of the user's code. Each role resolves what it uses, when it
starts, through `resolve(cfg, role)`: the actor its team, tools and reward; the broker its
team and task source; a learner nothing; `drmas train` everything, before it starts a
process. (Trackers are the broker's: drmas/broker/trackers.py.) Errors are ConfigErrors
that say what to fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from drmas.config.errors import ConfigError
from drmas.plugins import TargetError, load_object, registered_teams

if TYPE_CHECKING:
    from drmas.config import DrmasConfig
    from drmas.config.actor import WorkflowConfig
    from drmas.teams.base import Team


def team_class(cfg: WorkflowConfig, agents: Sequence[str] = ()) -> type[Team]:
    """The team class of `workflow.target`, else of the registered `workflow.name`. A
    target that is an async function is a program (drmas/teams/program): its team's
    agents are `agents`, the config's."""
    from drmas.teams.base import Team

    if cfg.target:
        what, target = "workflow.target", cfg.target
    else:
        teams = registered_teams()
        if cfg.name not in teams:
            raise ConfigError(
                f"workflow.name={cfg.name!r} is not a registered team {sorted(teams)}; for "
                "your own team set workflow.target=package.module:Class or "
                "path/to/file.py:Class"
            )
        what, target = "workflow.name", teams[cfg.name]
    try:
        cls = load_object(target, what)
    except (TargetError, ImportError, SyntaxError) as exc:
        raise ConfigError(str(exc)) from exc
    if cfg.target and inspect.iscoroutinefunction(cls):
        from drmas.teams.program import program_team

        return program_team(target, cls, tuple(agents))
    if not (isinstance(cls, type) and issubclass(cls, Team)):
        raise ConfigError(
            f"{what}={target!r} is neither a subclass of drmas.teams.Team nor a program "
            "(async def episode(client, task))"
        )
    for attr in ("name", "agents", "default_instructions", "layout"):
        if not hasattr(cls, attr):
            raise ConfigError(f"team {target!r} does not declare {attr!r} (see docs/own-team.md)")
    return cls


Need = Literal["team", "tools", "task"]

ROLE_NEEDS: dict[str, tuple[Need, ...]] = {
    "run": ("team", "tools", "task"),  # drmas train / prepare: checked before anything starts
    "broker": ("team", "task"),
    "actor": ("team", "tools"),
    "learner": (),
    "eval": ("team", "tools", "task"),
    "probe": ("team", "tools", "task"),
}
"""What each role imports of the user's code (and so checks when it starts)."""


def resolve(cfg: DrmasConfig, role: str) -> type[Team] | None:
    """Load and check the plug-ins `role` uses; the team class when it uses one. Raises
    ConfigError saying what to fix."""
    needs = ROLE_NEEDS[role]
    team = resolve_team(cfg) if "team" in needs else None
    if "tools" in needs:
        check_functions(cfg)
    if "task" in needs:
        check_task_source(cfg)
    return team


def resolve_team(cfg: DrmasConfig) -> type[Team]:
    """The run's team class, checked against the config's agents and team settings."""
    team = team_class(cfg.workflow, list(cfg.agents))
    expected = set(team.agents)
    if set(cfg.agents) != expected:
        missing, extra = sorted(expected - set(cfg.agents)), sorted(set(cfg.agents) - expected)
        raise ConfigError(
            f"the {team.name} team has agents {sorted(expected)}, the config's `agents` names "
            f"{sorted(cfg.agents)} (missing {missing}, not in the team {extra}): bind each "
            "of the team's agents to a model in your config file (agents: {NAME: {model: "
            "MODEL}}), or replace them on the command line: '~agents' "
            "'+agents={NAME: {model: MODEL}, ...}'"
        )
    if cfg.workflow.prompt_style not in team.default_instructions:
        raise ConfigError(
            f"workflow.prompt_style={cfg.workflow.prompt_style!r} is not one of "
            f"{list(team.default_instructions)}"
        )
    team.check_config(cfg)
    return team


def team_name(cfg: DrmasConfig) -> str:
    """What logs and reports call the run's team: the class's own name for a target."""
    return team_class(cfg.workflow).name if cfg.workflow.target else cfg.workflow.name


def check_functions(cfg: DrmasConfig) -> None:
    """`workflow.reward` and `workflow.tools` name loadable functions (tools: async ones)."""
    named = {f"workflow.tools.{n}": t for n, t in cfg.workflow.tools.items()}
    if cfg.workflow.reward:
        named["workflow.reward"] = cfg.workflow.reward
    for key, target in named.items():
        try:
            fn = load_object(target, key)
        except (TargetError, ImportError, SyntaxError) as exc:
            raise ConfigError(str(exc)) from exc
        is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004 - an instance may be the tool
        )
        if not callable(fn) or (key != "workflow.reward" and not is_async):
            kind = (
                "a function (task, answer) -> float"
                if key == "workflow.reward"
                else "an async function (argument: str) -> str"
            )
            raise ConfigError(f"{key}={target!r} must be {kind}")


def check_task_source(cfg: DrmasConfig) -> None:
    """`task.name` is a built-in task source, a file kind, or a loadable function."""
    from drmas.tasks.source import BUILTIN_SOURCES, FILE_KINDS

    name = cfg.task.name
    if name in BUILTIN_SOURCES or name in FILE_KINDS:
        return
    if ":" not in name:
        raise ConfigError(
            f"task.name={name!r}: choose {', '.join([*BUILTIN_SOURCES, *FILE_KINDS])}, or give "
            "your own task source as package.module:fn or path/to/file.py:fn"
        )
    try:
        fn = load_object(name, "task.name")
    except (TargetError, ImportError, SyntaxError) as exc:
        raise ConfigError(str(exc)) from exc
    if not callable(fn):
        raise ConfigError(f"task.name={name!r} is not a function (TaskConfig) -> (train, val)")
