"""What a publish must carry for the engine that serves a model: the actor's
WeightReceiver asks here, per join, and refuses a header that does not name exactly this
set (drmas/transports/weights/layout.py, `check_covers`) before loading a byte of it.

An engine that knows what it holds says so with `expected_weights(adapters)`: the hf
engine from its live model, sim, vLLM and SGLang from the model folder's architecture
(built on the meta device, no weights read: the same classes and names the learner
loads). On a LoRA base a publish carries the adapters that changed (the join names
them): every parameter of those adapters, and nothing else. An engine that cannot tell
(sim without a model folder) returns None and its headers are checked for sizes only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from drmas.models.lora import adapter_of_param
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.weights import Expected
from drmas.transports.weights.layout import expected_of

if TYPE_CHECKING:
    from drmas.config.model import LoraConfig

log = logging.getLogger("drmas.engine")


def expected_for(engine: object, join: JoinWeightGroup) -> Expected | None:
    """The engine's expectation for this join (None: the engine cannot tell)."""
    expected_weights = getattr(engine, "expected_weights", None)
    if expected_weights is None:
        return None
    found: Expected | None = expected_weights(list(join.adapters))
    return found


@functools.lru_cache(maxsize=8)
def folder_expected(folder: str) -> Expected | None:
    """Every parameter of the causal LM in `folder` (a Hugging Face folder with a
    config.json), by the names, shapes and dtypes `AutoModelForCausalLM` gives it, as the
    learner loads it: built on the meta device, so nothing is allocated or read. None
    when the folder has no config.json or its architecture cannot be built here."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(folder) / "config.json").is_file():
        return None
    try:
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError, ImportError) as exc:
        log.warning("cannot tell which parameters %s holds (%s): headers checked for size only",
                    folder, exc)  # fmt: skip
        return None
    return expected_of(model.named_parameters(), f"every parameter of {folder}")


_ADAPTERS: dict[tuple[str, str, tuple[str, ...]], Expected] = {}
"""(folder, LoRA settings, adapters) -> every adapter parameter: one per engine."""


def adapters_expected(
    folder: str | Path, lora: LoraConfig, adapters: Sequence[str], carried: Sequence[str]
) -> Expected:
    """Every parameter of the adapters `carried` (of the engine's `adapters` on the base in
    `folder`), by the wire names, shapes and dtypes the learner publishes them under: the
    engine's initial adapters, built as the learner builds them (lora_folders.py). A join
    that names no adapters (an older broker, or a publish that carries none) may carry
    whole adapters only."""
    from drmas.actors.engines.lora_folders import initial_adapter_tensors

    key = (str(folder), repr(lora), tuple(adapters))
    if key not in _ADAPTERS:
        if len(_ADAPTERS) >= 8:
            _ADAPTERS.clear()
        initial = initial_adapter_tensors(Path(folder), lora, list(adapters))
        _ADAPTERS[key] = expected_of(initial, "")
    every = _ADAPTERS[key].specs
    if not carried:  # a join that does not say: any whole adapters, none in part
        return Expected(every, f"whole adapters of {folder}", adapter_of_param)
    wanted = set(carried)
    specs = {name: spec for name, spec in every.items() if adapter_of_param(name) in wanted}
    return Expected(specs, f"the parameters of adapters {sorted(wanted)} on {folder}")


def pack(expected: Expected | None) -> bytes:
    """An expectation as bytes for a worker process (vLLM's collective_rpc): b"" for none."""
    if expected is None:
        return b""
    specs = {name: [list(shape), dtype] for name, (shape, dtype) in expected.specs.items()}
    by_adapter = expected.group_of is not None  # the only grouping engines use
    return msgspec.msgpack.encode({"what": expected.what, "specs": specs, "by": by_adapter})


def unpack(raw: bytes) -> Expected | None:
    """`pack`'s inverse, in the worker."""
    if not raw:
        return None
    data = msgspec.msgpack.decode(raw)
    specs = {name: (tuple(shape), str(dtype)) for name, (shape, dtype) in data["specs"].items()}
    return Expected(specs, str(data["what"]), adapter_of_param if data.get("by") else None)
