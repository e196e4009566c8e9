"""What a publish must carry for the engine that serves a model: the actor's
WeightReceiver asks here, per join, and refuses a header that does not name exactly this
set (drmas/transports/weights/layout.py, `check_covers`) before loading a byte of it.

An engine that knows what it holds says so with `expected_weights(adapters)`: the hf
engine from its live model, sim and vLLM from the model folder's architecture (built on
the meta device, no weights read: the same classes and names the learner loads). An
engine that cannot tell returns None and its headers are checked for sizes only.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import msgspec

from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.weights import Expected
from drmas.transports.weights.layout import expected_of

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


def pack(expected: Expected | None) -> bytes:
    """An expectation as bytes for a worker process (vLLM's collective_rpc): b"" for none."""
    if expected is None:
        return b""
    specs = {name: [list(shape), dtype] for name, (shape, dtype) in expected.specs.items()}
    return msgspec.msgpack.encode({"what": expected.what, "specs": specs})


def unpack(raw: bytes) -> Expected | None:
    """`pack`'s inverse, in the worker."""
    if not raw:
        return None
    data = msgspec.msgpack.decode(raw)
    specs = {name: (tuple(shape), str(dtype)) for name, (shape, dtype) in data["specs"].items()}
    return Expected(specs, str(data["what"]))
