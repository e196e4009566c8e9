"""Sharded learner checkpoints with torch.distributed.checkpoint (DCP).

Called by every rank of one model's learner group (drmas/learners/main.py); each function
is a collective of that group. The folders themselves (manifest written last, atomic
rename, keep-N rotation) are drmas/checkpoints/store.py's, shared with the broker.

What is saved, at version v (= optimizer steps taken):

- model and optimizer state, FSDP2-aware: `get_state_dict` gives each rank its DTensor
  shards, DCP writes one file per rank plus `.metadata` (rank 0); of the trained
  parameters only: on a LoRA base the adapters and their AdamW state (the frozen base is
  loaded from the model's folder again), with full fine-tuning every parameter;
- the RNG state of every rank (torch CPU, CUDA when used, python, numpy) in rng-rank<r>.pt;
- the version and world size, in the manifest rank 0 writes last (drmas/checkpoints/store.py);
  on a LoRA base also each adapter's own version (`adapter_versions`, AdapterSet.versions),
  which a resume restores (AdapterSet.restore says what a checkpoint without it resumes
  with).

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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from drmas.checkpoints import store

if TYPE_CHECKING:
    from drmas.learners.trainer import Trainer

log = logging.getLogger("drmas.learner")

_TRAINED = StateDictOptions(ignore_frozen_params=True)
"""Only what trains: on a LoRA base the adapters (the frozen base is the model's own
folder, loaded again at a resume); with full fine-tuning, every parameter."""
_LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Setting them leaves the frozen base alone (not strict: the base is not in the state);
dcp.load has already checked that the checkpoint holds every trained parameter."""


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
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(trainer.device), tmp / f"rng-rank{rank}.pt")
    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, digest)  # also: every rank's files are written
    final = model_dir / store.step_name(version)
    if rank == 0:
        extra: dict[str, Any] = {"model": trainer.name, "optim_digests": digests}
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
    adapters' versions; returns the optimizer digest after loading."""
    if checkpoint.world_size != trainer.world_size:
        raise ValueError(
            f"checkpoint {checkpoint.path} was saved by {checkpoint.world_size} ranks, this "
            f"learner group has {trainer.world_size}; resume with the same world size"
        )
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=_TRAINED)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(checkpoint.path))
    set_state_dict(
        trainer.model,
        trainer.optimizer,
        model_state_dict=model_sd,
        optim_state_dict=optim_sd,
        options=_LOAD_TRAINED,
    )
    # weights_only: a checkpoint folder on shared storage must not be able to run code
    rng = torch.load(checkpoint.path / f"rng-rank{trainer.rank}.pt", weights_only=True)
    set_rng_state(rng, trainer.device)
    if trainer.lora:
        manifest = store.read_manifest(checkpoint.path) or {}
        trainer.lora.restore(manifest.get("adapter_versions"), checkpoint.version)
    _, loaded = get_state_dict(trainer.model, trainer.optimizer, options=_TRAINED)
    digest = optimizer_digest(loaded)
    dist.barrier()
    log.info(
        "%s rank %d: resumed from checkpoint %s at v%d (optimizer digest %s)",
        trainer.name, trainer.rank, checkpoint.path, checkpoint.version, digest,
    )  # fmt: skip
    return digest


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


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every generator's state as tensors and plain numbers only, so that it loads with
    torch.load(weights_only=True) (no pickle)."""
    py_version, py_words, py_gauss = random.getstate()
    np_kind, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": {
            "version": py_version,
            "words": torch.tensor(py_words, dtype=torch.int64),
            "gauss": py_gauss,
        },
        "numpy": {
            "kind": np_kind,
            "key": torch.from_numpy(np.asarray(np_key, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "gauss": float(np_gauss),
        },
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["words"].tolist()), py["gauss"]))
    n = state["numpy"]
    key = n["key"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], key, n["pos"], n["has_gauss"], n["gauss"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
