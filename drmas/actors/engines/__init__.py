"""Rollout engines behind one interface (base.py). `make_engine` picks one by name."""

from __future__ import annotations

from pathlib import Path

from drmas.actors.config import EngineConfig
from drmas.actors.engines.base import Engine


def _hf(model_name: str, path: str, cfg: EngineConfig) -> Engine:
    from drmas.actors.engines.hf import HFEngine

    return HFEngine(model_name, Path(path), cfg)


def _sim(model_name: str, path: str, cfg: EngineConfig) -> Engine:
    from drmas.actors.engines.sim import SimEngine

    return SimEngine(model_name, path, cfg)


_ENGINES = {"hf": _hf, "sim": _sim}


def make_engine(model_name: str, path: str, cfg: EngineConfig) -> Engine:
    """Build (not start) the engine `cfg.name` for one model pool."""
    factory = _ENGINES.get(cfg.name)
    if factory is None:
        raise ValueError(
            f"actor.engine.name={cfg.name!r} is not available in this build "
            f"(available: {sorted(_ENGINES)}); use actor.engine.name=hf (or sim: no model, a timing model)"
        )
    return factory(model_name, path, cfg)
