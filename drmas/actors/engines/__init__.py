"""Rollout engines behind one interface (base.py). `make_engine` picks one by name.

Engines whose model lives in other processes (vllm: its worker processes) receive a
weight publish themselves: they implement `ReceivesWeights`, and the actor
(drmas/actors/main.py) hands them the JoinWeightGroup instead of receiving the tensors
itself and calling `load_weights`.

On a LoRA model (models.<m>.lora.rank > 0) every engine serves one copy of the frozen base
and the adapters of the agents bound to it: `make_engine` passes the model's LoraConfig and
adapter names (DrmasConfig.adapters_of) on, and each request names its adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from drmas.actors.engines.base import Engine
from drmas.config.actor import EngineConfig
from drmas.config.model import LoraConfig

if TYPE_CHECKING:
    import torch

    from drmas.protocol.messages import JoinWeightGroup


@runtime_checkable
class ReceivesWeights(Protocol):
    """An engine that joins a weight group from its own processes."""

    async def receive_weights(self, join: JoinWeightGroup, digest: bool) -> str:
        """Join `join`'s group, load every bucket into the running model (call only while
        paused), set `version` to `join.version`; return the drmas digest of the loaded
        weights ("" when `digest` is False or they cannot be read back)."""
        ...


@runtime_checkable
class LoadsAdapters(Protocol):
    """An engine whose LoRA adapters load asynchronously from tensors held in this process
    (vLLM: its workers read new adapter folders), not through `load_weights`."""

    async def load_adapters(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Serve these adapter tensors (PeftModel names) from now on; the others stay."""
        ...


@runtime_checkable
class RollsBack(Protocol):
    """An in-process engine that can keep its current weights aside during a load, so a
    publish that fails half-way leaves the previous version serving."""

    def backup_weights(self) -> object:
        """What `restore_weights` needs to put the current weights (and version) back."""
        ...

    def restore_weights(self, backup: object) -> None:
        """Undo every load since `backup` was taken (call only while paused)."""
        ...


@runtime_checkable
class ReadsBack(Protocol):
    """An in-process engine whose loaded tensors can be read where they lie: the receiver
    hashes them once a bucket is loaded (instead of the bucket), so its one pass both
    checks the publish's digest and gives the engine's fingerprint."""

    def loaded_view(
        self,
    ) -> Callable[[list[str]], list[tuple[str, torch.Tensor]]] | None:
        """The engine's tensors by name as `load_weights` left them, when their
        fingerprint over a whole publish is `weights_digest()` (else None: a LoRA base's
        fingerprint also covers adapters a publish may not carry)."""
        ...


def _hf(model_name: str, path: str, cfg: EngineConfig, adapters: dict[str, Any]) -> Engine:
    from drmas.actors.engines.hf import HFEngine

    return HFEngine(model_name, Path(path), cfg, **adapters)


def _sim(model_name: str, path: str, cfg: EngineConfig, adapters: dict[str, Any]) -> Engine:
    from drmas.actors.engines.sim import SimEngine

    # no model: a request's adapter changes nothing, the adapters shape only its digest
    return SimEngine(model_name, path, cfg, **adapters)


def _vllm(model_name: str, path: str, cfg: EngineConfig, adapters: dict[str, Any]) -> Engine:
    from drmas.actors.engines.vllm import VLLMEngine, require_vllm

    require_vllm()  # fail here, before any training starts, with what to install
    return VLLMEngine(model_name, Path(path), cfg, **adapters)


def _sglang(model_name: str, path: str, cfg: EngineConfig, adapters: dict[str, Any]) -> Engine:
    from drmas.actors.engines.sglang import SGLangEngine
    from drmas.actors.engines.sglang_server import SGLangOptions, require_sglang

    opts = SGLangOptions.from_config(cfg)
    require_sglang(opts)  # "pip install 'drmas[sglang]'" before training starts
    return SGLangEngine(model_name, path, cfg, opts, **adapters)


_ENGINES = {"hf": _hf, "sim": _sim, "vllm": _vllm, "sglang": _sglang}


def make_engine(
    model_name: str,
    path: str,
    cfg: EngineConfig,
    lora: LoraConfig | None = None,
    adapters: Sequence[str] = (),
) -> Engine:
    """Build (not start) the engine `cfg.name` for one model pool. `lora` and `adapters`:
    the model's LoraConfig and adapter names when it is a LoRA base (each engine then
    takes them as the keyword arguments `lora=` and `adapters=`); None and () otherwise."""
    factory = _ENGINES.get(cfg.name)
    if factory is None:
        raise ValueError(
            f"actor.engine.name={cfg.name!r} is not available in this build "
            f"(available: {sorted(_ENGINES)}); use actor.engine.name=hf (or sim: no model, a timing model)"
        )
    if (lora is not None and lora.rank > 0) != bool(adapters):
        raise ValueError(
            f"model {model_name!r}: a LoRA base needs lora.rank > 0 and its adapter names "
            f"(got rank {lora.rank if lora else 0}, adapters {list(adapters)})"
        )
    kwargs: dict[str, Any] = {"lora": lora, "adapters": list(adapters)} if adapters else {}
    return factory(model_name, path, cfg, kwargs)
