"""From configs/ and the command line to one typed DrmasConfig, converted once.

    configs/config.yaml + experiment/deploy groups + overrides   (hydra compose)
      or a run's resolved config.yaml + overrides                 (--config FILE)
    -> a plain mapping over the schema's defaults                 (OmegaConf, untyped)
    -> DrmasConfig                                                (msgspec.convert: every
       field's type, range and choices; drmas/config/types.py)
    -> rules.check                                                (rules across fields)

Every override's key is checked against the schema before hydra sees it, and every key of
a config file after composing, so a typo is refused with the nearest keys instead of being
dropped. Plug-ins are not loaded here (drmas/plugins.py). No torch import.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from pathlib import Path
from typing import Any

import msgspec

from drmas.config import rules, schema
from drmas.config.errors import ConfigError
from drmas.config.root import DrmasConfig

FREE_MAPPINGS = ("probe.rewards", "workflow.tools", "workflow.options", "task.options")
"""Mappings whose keys are the user's own (any name is a valid key)."""

TARGET_KEYS = ("workflow.target", "workflow.reward", "task.name")
"""Options that may name a file (path/to/file.py:Name); `workflow.tools.*` too."""


def config_dir() -> Path:
    """configs/ at the repo root, or $DRMAS_CONFIG_DIR."""
    env = os.environ.get("DRMAS_CONFIG_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "configs"


def defaults() -> dict[str, Any]:
    """The schema's defaults as plain data: the base every config file is merged over."""
    plain = msgspec.to_builtins(DrmasConfig())
    assert isinstance(plain, dict)
    return plain


def register() -> None:
    """`drmas_schema` for configs/config.yaml's defaults list: the schema's defaults."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="drmas_schema", node=defaults())


def load_config(overrides: list[str], config_file: str | None = None) -> DrmasConfig:
    """Compose configs/config.yaml (or a run's resolved config.yaml) with overrides and
    convert the result once; raises ConfigError saying which key and what to do."""
    problem = schema.check_overrides(overrides, DrmasConfig, FREE_MAPPINGS)
    if problem:  # before hydra: its own advice for a typo is to add it with `+`
        raise ConfigError(problem)
    data = _compose(overrides, Path(config_file).resolve() if config_file else None)
    problem = _unknown_file_key(data, DrmasConfig, "")
    if problem:
        raise ConfigError(problem)
    return rules.check(convert(data))


def convert(data: dict[str, Any]) -> DrmasConfig:
    """Plain data -> DrmasConfig, every field checked against its declared type."""
    try:
        return msgspec.convert(
            _strings_where_expected(data, DrmasConfig), DrmasConfig, strict=False
        )
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(exc, data)) from None


def _compose(overrides: list[str], config_file: Path | None) -> dict[str, Any]:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        if config_file:
            merged = OmegaConf.merge(OmegaConf.create(defaults()), OmegaConf.load(config_file))
            _apply_dotlist(merged, overrides)
        else:
            register()
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
                merged = compose(config_name="config", overrides=[_as_set(o) for o in overrides])
        _absolute_targets(merged, overrides, config_file)
        data = OmegaConf.to_container(merged, resolve=True)
    except (HydraException, OmegaConfBaseException) as exc:
        hint = ""
        if "Environment variable" in str(exc):  # ${oc.env:...} of a deploy config
            hint = "\nexport that variable, or pass the key as an override instead"
        raise ConfigError(f"bad config or override: {exc}{hint}") from None
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items() if k != "hydra"}


def _as_set(override: str) -> str:
    """A plain `key=value` of a schema key (already checked) as hydra's `++key=value`: set
    it whether or not the composed files mention the key (the base is untyped, so a key a
    file leaves out, e.g. models.solver.lr, is not there to override)."""
    key = override.split("=", 1)[0]
    if "=" not in override or key.startswith(("+", "~")) or key in schema.GROUPS:
        return override
    if key.startswith("hydra"):
        return override
    return "++" + override


def _apply_dotlist(merged: Any, overrides: list[str]) -> None:
    """Overrides on a --config file: `key=value` sets, `~key` deletes (no hydra here)."""
    from omegaconf import OmegaConf

    for override in overrides:
        if override.startswith("~"):
            parent, _, leaf = override[1:].split("=", 1)[0].rpartition(".")
            node = OmegaConf.select(merged, parent) if parent else merged
            if node is not None and leaf in node:
                del node[leaf]
            continue
        merged.merge_with(OmegaConf.from_dotlist([override.lstrip("+")]))


def _absolute_targets(merged: Any, overrides: list[str], config_file: Path | None) -> None:
    """Make `file.py:Name` targets absolute, so every process of the run (started anywhere,
    reading the run's config.yaml) loads the same file: a target written in a --config
    file is relative to that file's folder, one given on the command line to the working
    directory."""
    from omegaconf import OmegaConf

    from drmas.config.targets import absolute_target

    given = {o.split("=", 1)[0].lstrip("+") for o in overrides}
    tools = OmegaConf.select(merged, "workflow.tools") or {}
    models = OmegaConf.select(merged, "models") or {}
    own_warm_starts = [
        f"models.{m}.warmstart.workflow"
        for m in models
        if ".py:" in str(OmegaConf.select(merged, f"models.{m}.warmstart.workflow") or "")
    ]  # a warm start's transcripts from a file of yours (a name or module:NAME stays)
    for key in (*TARGET_KEYS, *(f"workflow.tools.{name}" for name in tools), *own_warm_starts):
        value = OmegaConf.select(merged, key)
        if isinstance(value, str) and value:
            base = config_file.parent if config_file and key not in given else Path.cwd()
            OmegaConf.update(merged, key, absolute_target(value, base))


def _fields(cls: type) -> dict[str, Any]:
    """Field name -> its type, constraints (Annotated) unwrapped to the type itself."""
    return {k: _bare(tp) for k, tp in typing.get_type_hints(cls, include_extras=True).items()}


def _bare(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _unknown_file_key(data: Any, cls: type, prefix: str) -> str:
    """The first key of a composed config file that the schema does not have ("" if none)."""
    if not (dataclasses.is_dataclass(cls) and isinstance(data, dict)):
        return ""
    hints = _fields(cls)
    for key, value in data.items():
        where = f"{prefix}{key}"
        if key not in hints:
            return schema.unknown_key(where, DrmasConfig) or f"{where} is not a config key"
        tp = hints[key]
        if typing.get_origin(tp) is dict and dataclasses.is_dataclass(typing.get_args(tp)[1]):
            inner = typing.get_args(tp)[1]
            for name, item in (value or {}).items():
                if problem := _unknown_file_key(item, inner, f"{where}.{name}."):
                    return problem
        elif problem := _unknown_file_key(value, _dataclass_in(tp), f"{where}."):
            return problem
    return ""


def _dataclass_in(tp: Any) -> Any:
    """The dataclass of a field typed `X` or `X | None`, else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _is_str(tp: Any) -> bool:
    return tp is str or (
        typing.get_origin(tp) in (typing.Union, _UnionType) and str in typing.get_args(tp)
    )


try:  # X | Y annotations (3.10+)
    from types import UnionType as _UnionType
except ImportError:  # pragma: no cover
    _UnionType = typing.Union  # type: ignore[assignment,misc]


def _strings_where_expected(data: Any, tp: Any) -> Any:
    """A number given where the schema wants text (run.project=2024, actor.id=7: the
    command line's YAML reads them as numbers) becomes that text."""
    if _is_str(tp) and isinstance(data, (int, float)) and not isinstance(data, bool):
        return str(data)
    cls = _dataclass_in(tp)
    if cls is not None and isinstance(data, dict):
        hints = _fields(cls)
        return {
            k: _strings_where_expected(v, hints[k]) if k in hints else v for k, v in data.items()
        }
    if typing.get_origin(tp) is dict and isinstance(data, dict):
        inner = typing.get_args(tp)[1]
        return {k: _strings_where_expected(v, inner) for k, v in data.items()}
    return data


_PATH = re.compile(r"`\$((?:\.[A-Za-z_]\w*|\[[^\]]*\])*)`")


def _explain(exc: msgspec.ValidationError, data: dict[str, Any]) -> str:
    """msgspec's `Invalid enum value 'x' - at `$.actor.engine.name`` as
    `actor.engine.name='x' is not one of [...]`, with mapping keys filled in."""
    text = str(exc)
    match = _PATH.search(text)
    if not match:
        return f"bad config: {text}"
    parts = _resolve_parts(re.findall(r"\.(\w+)|\[([^\]]*)\]", match.group(1)), data)
    key = "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in parts).lstrip(".")
    value, tp = _lookup(data, parts)
    reason = text[: match.start()].removesuffix(" - at ").rstrip(" -")
    reason = reason.replace("Expected", "expected").replace("`", "")
    choices = _choices(tp)
    if choices:
        return f"{key}={value!r} is not one of {choices}"
    shown = f"={value!r}" if value is not _MISSING else ""
    return f"{key}{shown}: {reason}"


_MISSING = object()


def _resolve_parts(found: list[tuple[str, str]], data: Any) -> list[str]:
    """Path parts, with each `[...]` (a mapping key msgspec leaves out) replaced by the key
    whose value fails; list indices kept."""
    parts: list[str] = []
    node = data
    for name, index in found:
        if name:
            parts.append(name)
            node = node.get(name) if isinstance(node, dict) else None
        elif index == "...":
            bad = _first_bad_key(node, parts)
            parts.append(bad)
            node = node.get(bad) if isinstance(node, dict) else None
        else:
            parts.append(index)
            node = node[int(index)] if isinstance(node, list) and index.isdigit() else None
    return parts


def _first_bad_key(mapping: Any, parts: list[str]) -> str:
    _, tp = _lookup_type(parts)
    inner = _constrained_value_type(parts) if typing.get_origin(tp) is dict else Any
    for name, item in (mapping or {}).items():
        try:
            msgspec.convert(_strings_where_expected(item, inner), inner, strict=False)
        except msgspec.ValidationError:
            return str(name)
    return "<name>"


def _constrained_value_type(parts: list[str]) -> Any:
    """The value type of the mapping at `parts`, with its constraints (Annotated) kept."""
    *parent, name = parts
    _, owner = _lookup_type(parent)
    cls = _dataclass_in(owner)
    hints = typing.get_type_hints(cls, include_extras=True) if cls is not None else {}
    return typing.get_args(hints.get(name, dict[str, Any]))[1]


def _lookup_type(parts: list[str]) -> tuple[bool, Any]:
    tp: Any = DrmasConfig
    for part in parts:
        cls = _dataclass_in(tp)
        if cls is not None and part in _fields(cls):
            tp = _fields(cls)[part]
        elif typing.get_origin(tp) in (dict, list):
            tp = _bare(typing.get_args(tp)[-1])
        else:
            return False, None
    return True, tp


def _lookup(data: Any, parts: list[str]) -> tuple[Any, Any]:
    node = data
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            node = _MISSING
            break
    return node, _lookup_type(parts)[1]


def _choices(tp: Any) -> list[Any]:
    """The allowed values of a Literal-typed field."""
    tp = _bare(tp)
    if typing.get_origin(tp) is typing.Literal:
        return list(typing.get_args(tp))
    return []


def to_yaml(cfg: DrmasConfig) -> str:
    """The config as YAML (a run's config.yaml): load_config(--config) reads it back."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.create(config_dict(cfg)))


def config_dict(cfg: DrmasConfig) -> dict[str, Any]:
    """The config as plain dicts and lists (trackers' run configs, the run's config.yaml)."""
    plain = msgspec.to_builtins(cfg)
    assert isinstance(plain, dict)
    return plain
