"""The config schema as a user meets it: which override keys exist (with the nearest ones
for a typo) and the one-line doc of each option, read from the field docstrings of the
typed config dataclasses (drmas/config/).

Used by `load_config` (every key of every override is checked before hydra sees it, so a
typo given with `+` is refused too instead of being dropped) and by `drmas train --help`
and `drmas config`. No torch import.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import re
import textwrap
import typing
from functools import cache
from typing import Any

MAIN_OPTIONS = (
    "experiment",
    "train.steps",
    "group_size",
    "batch_groups",
    "algorithm.advantage.mode",
    "algorithm.max_staleness",
    "models.<name>.path",
    "models.<name>.lr",
    "models.<name>.precision",
    "actor.num_actors",
    "actor.engine.name",
    "actor.engine.device",
    "learner.device",
    "val.every",
    "val.n",
    "val.k",
    "run.dir",
    "run.resume",
    "broker.address",
    "security.curve",
    "checkpoint.every",
)
"""Shown by `drmas train --help`; `drmas config` prints everything."""

GROUPS = ("experiment", "deploy")
"""Config groups under configs/ (chosen by name, not keys of the schema)."""


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the dataclass body (first line)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _value_type(tp: Any) -> tuple[str, Any]:
    """("dataclass", cls) | ("mapping", value type) | ("leaf", tp)."""
    if dataclasses.is_dataclass(tp):
        return "dataclass", tp
    if typing.get_origin(tp) is dict:
        return "mapping", typing.get_args(tp)[1]
    return "leaf", tp


def unknown_key(key: str, root: type) -> str:
    """ "" if `key` (dotted) names an option of `root`, else why not, with the nearest keys."""
    kind, node = "dataclass", root
    path: list[str] = []
    for part in key.split("."):
        if kind == "leaf":
            return f"{'.'.join(path)} is a value, not a group: {key} is not a config key"
        if kind == "mapping":  # a free name (models.<name>, agents.<name>, ...)
            kind, node = _value_type(node)
            path.append(part)
            continue
        names = [f.name for f in dataclasses.fields(node)]
        if part not in names:
            where = ".".join(path) or "the top level"
            near = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            prefix = ".".join(path) + "." if path else ""
            hint = f"; did you mean {' or '.join(prefix + n for n in near)}?" if near else ""
            return (
                f"{key} is not a config key{hint} (keys of {where}: {', '.join(names)}; "
                "`drmas config` prints them all)"
            )
        kind, node = _value_type(_hints(node)[part])
        path.append(part)
    return ""


def check_overrides(overrides: list[str], root: type, free: tuple[str, ...] = ()) -> str:
    """The first problem with an override's key ("" if none). `+key`, `++key` and `~key`
    are checked like `key`; config groups and `hydra.*` are left to hydra; keys under a
    free-form mapping in `free` (e.g. probe.rewards) may be anything."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~").strip()
        if not key or key in GROUPS or key.startswith("hydra"):
            continue
        if any(key == f or key.startswith(f + ".") for f in free):
            continue
        problem = unknown_key(key, root)
        if problem:
            return problem
    return ""


GROUP_DOCS = {
    "experiment": ("which team and task", "tiny_math"),
    "deploy": ("where the roles run", "local"),
}
"""Config group -> (what it chooses, its default); its choices are the YAML files in it."""


def group_choices(group: str) -> list[str]:
    """The names a config group can take: its YAML files under configs/, so a new
    experiment shows up in --help by itself."""
    from drmas.config.load import config_dir

    return sorted(p.stem for p in (config_dir() / group).glob("*.yaml"))


def choices_of(tp: Any) -> tuple[str, ...]:
    """The values a Literal field (possibly Annotated) may take; () for any other type."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is typing.Literal:
        return tuple(str(v) for v in typing.get_args(tp))
    return ()


def option_doc(key: str, root: type) -> str:
    """One-line doc of a dotted option (models.<name>.lr style allowed), or ""."""
    return _option(key, root)[0]


def option_choices(key: str, root: type) -> tuple[str, ...]:
    """What a dotted option may be set to, when that is a fixed list (a Literal field, a
    config group); () otherwise."""
    return _option(key, root)[1]


def _option(key: str, root: type) -> tuple[str, tuple[str, ...]]:
    if key in GROUPS:
        what, default = GROUP_DOCS[key]
        names = [f"{n} (default)" if n == default else n for n in group_choices(key)]
        return f"{what}: {', '.join(names)}", ()
    kind, node, doc = "dataclass", root, ""
    for part in key.split("."):
        if kind == "mapping":
            kind, node = _value_type(node)  # any name of a mapping
            continue
        if kind != "dataclass":
            return "", ()
        doc = field_docs(node).get(part, "")
        hints = _hints(node)
        if part not in hints:
            return "", ()
        kind, node = _value_type(hints[part])
    return doc, (choices_of(node) if kind == "leaf" else ())


def _with_choices(doc: str, choices: tuple[str, ...]) -> str:
    """The doc's first sentence, then every choice (never cut off)."""
    first = _first_sentence(doc)
    return f"{first} One of: {', '.join(choices)}." if choices else first


def _first_sentence(doc: str, limit: int = 170) -> str:
    first = re.split(r"(?<!Dr)\.\s+(?=[A-Z])", doc)[0].split(": - ")[0].rstrip(":;, ")
    first = first if first.endswith(".") or not first else first + "."
    return first if len(first) <= limit else first[: limit - 3].rstrip() + "..."


def options_help(root: type, keys: tuple[str, ...] = MAIN_OPTIONS, width: int = 88) -> str:
    """The main options with their docs, for an argparse epilog."""
    lines = ["main options (hydra overrides, KEY=VALUE; `drmas config` prints every key):"]
    pad = max(len(k) for k in keys) + 2
    for key in keys:
        doc = _with_choices(*_option(key, root))
        wrapped = textwrap.wrap(doc, width - pad - 2) or [""]
        lines.append(f"  {key:<{pad}}{wrapped[0]}")
        lines += [f"  {'':<{pad}}{more}" for more in wrapped[1:]]
    return "\n".join(lines)


def config_text(cfg: Any, group: str = "", *, docs: bool = False) -> str:
    """YAML of the resolved config or of one dotted group; with docs, one `key: value  #
    doc` line per option instead."""
    from omegaconf import OmegaConf

    from drmas.config.load import config_dict

    node = OmegaConf.create(config_dict(cfg))
    if group:
        problem = unknown_key(group, type(cfg))
        if problem:
            raise KeyError(problem)
        node = OmegaConf.select(node, group)
    if not docs:
        if not OmegaConf.is_config(node):
            return f"{group}: {node}\n"
        return OmegaConf.to_yaml(node)
    plain = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node
    # the config groups first (not keys of the config: chosen with `experiment=NAME`)
    lines = [f"# {name}=NAME  # {_option(name, type(cfg))[0]}" for name in GROUP_DOCS if not group]
    for key, value in _leaves(plain, group):
        generic = ".".join(_generic_parts(key, type(cfg)))
        doc = _with_choices(*_option(generic, type(cfg)))
        lines.append(f"{key}: {value!r}" + (f"  # {doc}" if doc else ""))
    return "\n".join(lines) + "\n"


def _leaves(value: Any, prefix: str) -> list[tuple[str, Any]]:
    if isinstance(value, dict) and value:
        return [
            leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else k)
        ]
    return [(prefix, value)]


def _generic_parts(key: str, root: type) -> list[str]:
    """models.solver.lr -> [models, <name>, lr]: free names of mappings replaced."""
    kind, node, out = "dataclass", root, []
    for part in key.split("."):
        if kind == "mapping":
            out.append("<name>")
            kind, node = _value_type(node)
            continue
        out.append(part)
        if kind != "dataclass":
            break
        hints = _hints(node)
        if part not in hints:
            break
        kind, node = _value_type(hints[part])
    return out
