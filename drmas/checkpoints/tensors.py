"""Learner checkpoint files without pickle: safetensors for tensors, JSON for the rest.

Written by every learner rank (drmas/learners/checkpoint.py) into one checkpoint folder
(drmas/checkpoints/store.py); read back by the same ranks on resume and, without a process
group, by `drmas eval --step` (drmas/launch/evaluate.py), which joins the shards into full
tensors.

Why not torch.distributed.checkpoint or torch.save: their readers unpickle (DCP reads its
`.metadata` with pickle.load and its non-tensor items with torch.load(weights_only=False)),
so whoever can write the checkpoint folder could run code in every learner at resume.
A safetensors file is a JSON header and raw bytes, the rest is JSON read by json.loads:
nothing read here can name a Python object to build.

Per rank r of a checkpoint folder (the manifest, written last, says `"format": FORMAT`,
drmas/checkpoints/store.py):

    rank-0000r.safetensors  this rank's tensors: "model/<fqn>" (its shard of each trained
                            parameter), "optim/<fqn>/<key>" (its shard of their optimizer
                            state), "rng/<name>" (its generators' states)
    rank-0000r.json         {"format", "rank", "world_size", "layout": {key: {"shape": the
                            full tensor's shape, "offset": where this shard starts in it}},
                            "param_groups": the optimizer's hyperparameters, "rng": the
                            generators' plain numbers}
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from drmas.checkpoints import store
from drmas.checkpoints.store import FORMAT, REDO, CheckpointError, check_format

MAX_JSON_BYTES = 64 * 1024 * 1024
"""A rank's JSON holds names, shapes and a few numbers: megabytes for the largest models."""


def tensors_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def layout_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def write_rank(
    folder: Path, rank: int, tensors: dict[str, torch.Tensor], doc: dict[str, Any]
) -> None:
    """Write this rank's tensors (copied to the CPU) and its JSON (`doc` plus format and rank)."""
    save_file({key: _cpu_copy(t) for key, t in tensors.items()}, str(folder / tensors_name(rank)))
    text = json.dumps({**doc, "format": FORMAT, "rank": rank}, sort_keys=True, allow_nan=False)
    (folder / layout_name(rank)).write_text(text)


def read_rank(
    folder: Path, rank: int, select: Callable[[str], bool] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors (those `select` keeps, on the CPU) and its JSON."""
    doc = read_json(folder / layout_name(rank))
    if doc.get("format") != FORMAT or doc.get("rank") != rank:
        raise CheckpointError(
            f"{folder / layout_name(rank)} is not rank {rank}'s file in format {FORMAT!r}: "
            f"changed or damaged; {REDO}"
        )
    if not isinstance(doc.get("layout"), dict):
        raise CheckpointError(f"{folder / layout_name(rank)} has no layout; {REDO}")
    path = folder / tensors_name(rank)
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names: list[str] = f.keys()  # the file's tensor names (not iterable itself)
            keys = [k for k in names if select is None or select(k)]
            return {k: f.get_tensor(k) for k in keys}, doc
    except (SafetensorError, OSError, RuntimeError, ValueError) as err:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({err}): changed or damaged; {REDO}"
        ) from None


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint folder, size-bounded; anything else is refused."""
    try:
        if path.stat().st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is over {MAX_JSON_BYTES} bytes; {REDO}")
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as err:
        if isinstance(err, CheckpointError):
            raise
        raise CheckpointError(
            f"{path} is not readable JSON ({type(err).__name__}): changed or damaged; {REDO}"
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object; {REDO}")
    return data


def full_tensors(folder: Path, select: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    """The full tensors (keys `select` keeps) of the checkpoint `folder`, each joined from
    every rank's shard at its offset; no process group needed. Refuses shards that fall
    outside their tensor or leave part of it unwritten."""
    world = check_format(folder, store.read_manifest(folder))
    full: dict[str, torch.Tensor] = {}
    written: dict[str, int] = {}
    for rank in range(world):
        shards, doc = read_rank(folder, rank, select)
        for key, shard in shards.items():
            shape, index = _place(folder, key, doc["layout"].get(key), shard)
            if key not in full:
                full[key] = torch.empty(shape, dtype=shard.dtype)
                written[key] = 0
            if shard.shape == full[key].shape:  # not sharded: every rank holds all of it
                full[key].copy_(shard)
                written[key] = full[key].numel()
            elif written[key] < full[key].numel():
                full[key][index] = shard
                written[key] += shard.numel()
    short = sorted(k for k, t in full.items() if written[k] != t.numel())
    if short:
        raise CheckpointError(f"{folder}: the ranks' shards do not make up {short[:3]}; {REDO}")
    return full


def _place(
    folder: Path, key: str, entry: Any, shard: torch.Tensor
) -> tuple[list[int], tuple[slice, ...]]:
    """(full shape, index of the shard in it) from the layout entry, checked against the shard."""
    try:
        shape = [int(n) for n in entry["shape"]]
        offset = [int(n) for n in entry["offset"]]
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(f"{folder}: no valid layout for {key}; {REDO}") from None
    local = list(shard.shape)
    if not (len(shape) == len(offset) == len(local)) or any(
        o < 0 or o + n > s for o, n, s in zip(offset, local, shape)
    ):
        raise CheckpointError(
            f"{folder}: shard {key} {local} at {offset} does not fit in {shape}; {REDO}"
        )
    return shape, tuple(slice(o, o + n) for o, n in zip(offset, local))


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU copy owning its memory (safetensors refuses tensors that share it,
    as tied parameters and views into FSDP's flat buffers do)."""
    return tensor.detach().to("cpu", copy=True).contiguous()
