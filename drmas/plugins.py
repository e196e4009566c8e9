"""Finding a team, a task source, a reward, a tool or warm-start transcripts from a string.

Every plug-in point of a run is a *target* string in the config:

    package.module:Name        imported like any module (installed, on PYTHONPATH, or
                               under the directory drmas was started from)
    path/to/file.py:Name       loaded from that file (relative paths resolve against the
                               --config file's folder, else the working directory)
    name                       a registered name: the built-in teams, and whatever installed
                               packages declare in the `drmas.teams` entry-point group

The built-in math and search teams are registered the same way (pyproject.toml), so
`workflow.name=math` and `workflow.target=drmas.teams.math:MathTeam` load the same class.

This module only finds and imports; checking what it loads against a run's config is
drmas/teams/resolve.py, a step each role takes for the plug-ins it uses.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from drmas.config.targets import absolute_target, is_file_target

__all__ = [
    "TargetError",
    "absolute_target",
    "is_file_target",
    "load_object",
    "registered_teams",
]

ENTRY_POINT_GROUP = "drmas.teams"
BUILTIN_TEAMS = {
    "math": "drmas.teams.math:MathTeam",
    "search": "drmas.teams.search:SearchTeam",
}
"""Also declared as entry points; listed here too so a source checkout that was not
reinstalled still finds them."""


class TargetError(ValueError):
    """A target string names nothing loadable; the message says what to write instead."""


def registered_teams() -> dict[str, str]:
    """Team name -> target, built-ins first, then installed packages' entry points."""
    teams = dict(BUILTIN_TEAMS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        teams.setdefault(ep.name, ep.value)
    return teams


def load_object(target: str, what: str) -> Any:
    """The object a `module:Name` or `file.py:Name` target names. `what` says which option
    gave it (for the error message)."""
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise TargetError(
            f"{what}={target!r}: expected package.module:Name or path/to/file.py:Name"
        )
    module = _load_file(module_part, what) if is_file_target(target) else _import(module_part, what)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(n for n in dir(module) if not n.startswith("_"))
            raise TargetError(
                f"{what}={target!r}: {module.__name__} has no {attr!r} (it defines {public[:20]})"
            )
        obj = getattr(obj, part)
    return obj


def _import(name: str, what: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not name.startswith(exc.name):
            raise  # the module exists but one of its own imports is missing
    # `drmas` is a console script, whose sys.path does not hold the working directory
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name):
                raise
    raise TargetError(
        f"{what}: cannot import module {name!r} (not installed, not on PYTHONPATH and not "
        f"under {cwd}); install its package, set PYTHONPATH, or give the file: "
        "path/to/file.py:Name"
    )


def _load_file(path: str, what: str) -> Any:
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise TargetError(f"{what}: no file {file}")
    # one module per file, whatever the caller calls it; its folder is importable, as when
    # the file runs as a script (so it may import its neighbours)
    digest = hashlib.sha256(str(file).encode()).hexdigest()[:10]
    name = f"drmas_plugin_{file.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise TargetError(f"{what}: cannot load {file} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
