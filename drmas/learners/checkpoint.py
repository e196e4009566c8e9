"""Sharded learner checkpoints in safetensors and JSON (no pickle on the way back in).

Called by every rank of one model's learner group (drmas/learners/main.py); each function
is a collective of that group. The folders themselves (manifest written last, atomic
rename, keep-N rotation) are drmas/checkpoints/store.py's, shared with the broker; the
files of one rank (and why not torch.distributed.checkpoint) are
drmas/checkpoints/tensors.py's.

What is saved, at version v (= optimizer steps taken):

- model and optimizer state, FSDP2-aware: `get_state_dict` gives each rank its DTensor
  shards, and each rank writes its own shards with their place in the full tensor; of the
  trained parameters only: on a LoRA base the adapters and their AdamW state (the frozen
  base is loaded from the model's folder again), with full fine-tuning every parameter;
- the optimizer's hyperparameters (param_groups) and the RNG state of every rank (torch
  CPU, CUDA when used, python, numpy), as tensors and JSON numbers;
- the version, world size and format, in the manifest rank 0 writes last
  (drmas/checkpoints/store.py); on a LoRA base also each adapter's own version
  (`adapter_versions`, AdapterSet.versions), which a resume restores (AdapterSet.restore
  says what a checkpoint without it resumes with).

A resume needs the same world size and sharding: each rank reads only its own files and
copies them into its shards, after checking every key, shape and offset.

There is no learning-rate scheduler (AdamW at a constant lr), so there is none to save.

Both save and load log a digest of this rank's optimizer state (exp_avg, exp_avg_sq and
step of every parameter shard), so a resume can be checked: the digest logged at load
equals the one logged at save of the same version.
"""

from __future__ import annotations

import hashlib
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from drmas.checkpoints import store
from drmas.checkpoints import tensors as files
from drmas.checkpoints.store import CheckpointError
from drmas.finite import describe, non_finite_names
from drmas.transports.digest import digest_of

if TYPE_CHECKING:
    from drmas.learners.trainer import Trainer

log = logging.getLogger("drmas.learner")

_TRAINED = StateDictOptions(ignore_frozen_params=True)
"""Only what trains: on a LoRA base the adapters (the frozen base is the model's own
folder, loaded again at a resume); with full fine-tuning, every parameter."""
_LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Setting them leaves the frozen base alone (not strict: the base is not in the state);
load has already checked that the checkpoint holds every trained parameter."""


def save(trainer: Trainer, model_dir: Path, version: int, keep: int) -> Path:
    """Collective: write the checkpoint of `version` atomically; returns its folder."""
    start = time.monotonic()
    rank, world = trainer.rank, trainer.world_size
    tmp = model_dir / store.tmp_name(version)
    if rank == 0:
        store.begin(model_dir, version)
    dist.barrier()
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_TRAINED)
    digest = optimizer_digest(optim_sd)
    out, layout = flatten(model_sd, optim_sd)
    rng_tensors, rng_numbers = rng_state(trainer.device)
    out.update({f"rng/{name}": t for name, t in rng_tensors.items()})
    doc = {
        "world_size": world,
        "layout": layout,
        "param_groups": _groups_to_json(optim_sd["param_groups"]),
        "rng": rng_numbers,
    }
    files.write_rank(tmp, rank, out, doc)
    mine = (digest, weights_digest(out))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, mine)  # also: every rank's files are written
    final = model_dir / store.step_name(version)
    if rank == 0:
        extra: dict[str, Any] = {
            "model": trainer.name,
            "optim_digests": [g[0] for g in gathered],
            "weights_digests": [g[1] for g in gathered],
            "format": store.FORMAT,
        }
        if trainer.lora:
            extra["adapter_versions"] = dict(trainer.lora.versions)
        final = store.commit(tmp, version, world, extra)
        for old in store.rotate(model_dir, keep):
            log.info("%s: deleted old checkpoint %s", trainer.name, old.name)
    dist.barrier()  # nobody goes on before the checkpoint is complete
    log.info(
        "%s rank %d: checkpoint v%d saved to %s in %.1fs (optimizer digest %s)",
        trainer.name, rank, version, final, time.monotonic() - start, digest,
    )  # fmt: skip
    return final


def load(trainer: Trainer, checkpoint: store.Checkpoint) -> str:
    """Collective: load model, optimizer, this rank's RNG state and, on a LoRA base, the
    adapters' versions; returns the optimizer digest after loading. Reads JSON and
    safetensors only (drmas/checkpoints/tensors.py): a checkpoint in another format, or
    one whose keys, shapes or shard offsets differ from this learner's, is refused."""
    manifest = store.read_manifest(checkpoint.path)
    world = store.check_format(checkpoint.path, manifest)
    if world != trainer.world_size:
        raise ValueError(
            f"checkpoint {checkpoint.path} was saved by {world} ranks, this "
            f"learner group has {trainer.world_size}; resume with the same world size"
        )
    saved, doc = files.read_rank(checkpoint.path, trainer.rank)
    _refuse_damaged(trainer, checkpoint, manifest, saved)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_TRAINED)
    where = checkpoint.path / files.layout_name(trainer.rank)
    with torch.no_grad():
        for key, live in _entries(model_sd, optim_sd):
            _copy_shard(where, key, live, saved, doc["layout"])
    _groups_from_json(where, optim_sd["param_groups"], doc.get("param_groups"))
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=_LOAD_TRAINED,
    )
    rng = {k.removeprefix("rng/"): t for k, t in saved.items() if k.startswith("rng/")}
    set_rng_state(rng, doc.get("rng"), trainer.device)
    if trainer.lora:
        trainer.lora.restore((manifest or {}).get("adapter_versions"), checkpoint.version)
    _, loaded = get_state_dict(trainer.model, trainer.optimizer, options=_TRAINED)
    digest = optimizer_digest(loaded)
    dist.barrier()
    log.info(
        "%s rank %d: resumed from checkpoint %s at v%d (optimizer digest %s)",
        trainer.name, trainer.rank, checkpoint.path, checkpoint.version, digest,
    )  # fmt: skip
    return digest


# ---------------------------------------------------------------- damaged weights
def weights_digest(saved: dict[str, torch.Tensor]) -> str:
    """Fingerprint of one rank's model shards (the `model/` keys of its file), recorded per
    rank in the manifest at save and compared at load."""
    return digest_of((k, t) for k, t in sorted(saved.items()) if k.startswith("model/"))


def _refuse_damaged(
    trainer: Trainer,
    checkpoint: store.Checkpoint,
    manifest: dict[str, Any] | None,
    saved: dict[str, torch.Tensor],
) -> None:
    """Collective: raise CheckpointError on every rank when any rank's model shards differ
    from the digest saved with them or hold NaN or inf (bytes changed on disk, or a
    checkpoint written before saves were checked). A damaged checkpoint used to load
    silently, go out to the actors and crash them later with a misleading message."""
    where = checkpoint.path / files.tensors_name(trainer.rank)
    problem = ""
    recorded = (manifest or {}).get("weights_digests")
    mine = (
        recorded[trainer.rank]
        if isinstance(recorded, list) and len(recorded) > trainer.rank
        else None
    )
    if mine is not None and mine != weights_digest(saved):
        problem = f"{where}: its weights differ from the digest saved with them"
    if not problem:
        bad = non_finite_names((k, t) for k, t in sorted(saved.items()) if k.startswith("model/"))
        if bad:
            problem = f"{where}: NaN or inf in {describe(bad)}"
    problems: list[Any] = [None] * trainer.world_size
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p]
    if found:
        raise CheckpointError(f"{'; '.join(found)}. {_instead(checkpoint)}")


def _instead(checkpoint: store.Checkpoint) -> str:
    """What to resume from instead of a damaged `checkpoint`."""
    folder = checkpoint.path
    earlier = [c for c in store.complete(folder.parent) if c.version < checkpoint.version]
    aside = f"mv {folder} {folder.parent}/damaged-{folder.name}"
    if not earlier:
        return (
            f"It is the oldest checkpoint of {folder.parent.name}: set it aside ({aside}) "
            "and resume (the run restarts that model from its initial weights), or start anew"
        )
    good = earlier[-1]
    return (
        f"Its weights are not loaded nor sent to the actors. The newest earlier checkpoint "
        f"is {good.path} (v{good.version}): set this one aside ({aside}) and resume again "
        "(drmas train run.resume=RUN_DIR); the run then continues from the newest checkpoint "
        "every model has"
    )


# ---------------------------------------------------------------- state <-> files
def flatten(
    model_sd: dict[str, Any], optim_sd: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's shards by file key, and each one's full shape and offset."""
    out: dict[str, torch.Tensor] = {}
    layout: dict[str, Any] = {}
    for key, value in _entries(model_sd, optim_sd):
        shape, offset = _placement(value)
        out[key] = _local(value)
        layout[key] = {"shape": shape, "offset": offset}
    return out, layout


def _entries(model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """(file key, tensor) of every model and optimizer-state entry; only tensors are state."""
    found = [(f"model/{fqn}", value) for fqn, value in model_sd.items()]
    for fqn, state in optim_sd.get("state", {}).items():
        found += [(f"optim/{fqn}/{key}", value) for key, value in state.items()]
    for key, value in found:
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"{key} is a {type(value).__name__}, not a tensor; the checkpoint format "
                "holds tensors and JSON hyperparameters only"
            )
    return found


def _copy_shard(
    where: Path, key: str, live: torch.Tensor, saved: dict[str, torch.Tensor], layout: Any
) -> None:
    """Copy the saved shard of `key` into the live tensor's shard, after checking it is the
    same part of the same tensor."""
    if key not in saved or not isinstance(layout, dict) or key not in layout:
        raise CheckpointError(
            f"{where} has no {key}: it was written for another model or configuration; "
            "resume with the run's own config.yaml"
        )
    shape, offset = _placement(live)
    entry, shard, local = layout[key], saved[key], _local(live)
    if (
        not isinstance(entry, dict)
        or entry.get("shape") != shape
        or entry.get("offset") != offset
        or list(shard.shape) != list(local.shape)
    ):
        raise CheckpointError(
            f"{where}: {key} is saved as {list(shard.shape)} of {entry} here, this rank "
            f"holds {list(local.shape)} of shape {shape} at {offset}; resume with the run's "
            "own config.yaml and world size"
        )
    local.copy_(shard)


def _placement(value: torch.Tensor) -> tuple[list[int], list[int]]:
    """(full shape, offset of this rank's shard in it)."""
    if isinstance(value, DTensor):
        _, offset = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return list(value.shape), list(offset)
    return list(value.shape), [0] * value.dim()


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _groups_to_json(groups: Any) -> list[dict[str, Any]]:
    """The optimizer's param_groups as JSON (numbers, flags, parameter names)."""
    out = []
    for group in groups:
        entry: dict[str, Any] = {}
        for name, value in group.items():
            value = list(value) if isinstance(value, tuple) else value
            items = value if isinstance(value, list) else [value]
            if not all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
                raise CheckpointError(
                    f"optimizer hyperparameter {name} is a {type(value).__name__}; the "
                    "checkpoint format holds numbers, flags and names only"
                )
            entry[name] = value
        out.append(entry)
    return out


def _groups_from_json(where: Path, live: Any, saved: Any) -> None:
    """Set the live param_groups' hyperparameters to the saved ones (tuples stay tuples),
    after checking both name the same parameters."""
    same = isinstance(saved, list) and len(saved) == len(live)
    same = same and all(
        isinstance(s, dict) and s.get("params") == list(g["params"]) for s, g in zip(saved, live)
    )
    if not same:
        raise CheckpointError(
            f"{where}: its optimizer parameter groups are not this learner's; resume with the "
            "run's own config.yaml"
        )
    for group, entry in zip(live, saved):
        for name, value in entry.items():
            if name != "params" and name in group:
                group[name] = tuple(value) if isinstance(group[name], tuple) else value


def optimizer_digest(optim_sd: dict[str, Any]) -> str:
    """sha256 over this rank's optimizer tensors: for each parameter (sorted by name) and
    each state key (sorted), the local shard's float32 bytes. Same world size, same digest."""
    h = hashlib.sha256()
    for name in sorted(optim_sd.get("state", {})):
        for key, value in sorted(optim_sd["state"][name].items()):
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                data = local.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
                h.update(f"{name}/{key}".encode())
                h.update(data)
    return h.hexdigest()[:16]


def rng_state(device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every generator's state as (tensors, JSON numbers), so that it is saved and read
    back without pickle (safetensors and JSON)."""
    py_version, py_words, py_gauss = random.getstate()
    np_kind, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    tensors = {
        "torch": torch.get_rng_state(),
        "python_words": torch.tensor(py_words, dtype=torch.int64),
        "numpy_key": torch.from_numpy(np.asarray(np_key, dtype=np.int64)),
    }
    if device.type == "cuda":
        tensors["cuda"] = torch.cuda.get_rng_state(device)
    numbers = {
        "python": {"version": py_version, "gauss": py_gauss},
        "numpy": {
            "kind": np_kind,
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }
    return tensors, numbers


def set_rng_state(tensors: dict[str, torch.Tensor], numbers: Any, device: torch.device) -> None:
    """Put back what rng_state returned; a part missing or of the wrong kind is refused."""
    try:
        py, n = numbers["python"], numbers["numpy"]
        words = tuple(int(w) for w in tensors["python_words"].tolist())
        key = tensors["numpy_key"].numpy().astype(np.uint32)
        torch.set_rng_state(tensors["torch"])
        random.setstate((int(py["version"]), words, py["gauss"]))
        np.random.set_state(
            (str(n["kind"]), key, int(n["pos"]), int(n["has_gauss"]), float(n["gauss"]))
        )
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise CheckpointError(
            f"the checkpoint's RNG state is incomplete or malformed ({type(err).__name__}: "
            f"{err}); resume from another checkpoint of the run"
        ) from None
    if device.type == "cuda" and "cuda" in tensors:
        torch.cuda.set_rng_state(tensors["cuda"], device)
