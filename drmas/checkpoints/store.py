"""Checkpoint folders on disk: names, manifests, atomic publication, rotation (no torch).

Layout under the checkpoint root (`checkpoint.dir`, default RUN_DIR/checkpoints):

    <model>/step-000012/            one learner group's sharded checkpoint at version 12
        rank-00000.safetensors ...  each rank's shards of model and optimizer state, RNG
        rank-00000.json ...         each rank's layout, hyperparameters, RNG numbers
                                    (both drmas/checkpoints/tensors.py: nothing is pickled)
        manifest.json               written LAST, by rank 0: version, world size, format,
                                    time, files
    <model>/.tmp-step-000012/       a save in progress (never read)
    <model>/.set-aside-*/           a checkpoint of a history that resume abandoned (never
                                    read; deleted at the next rotation)
    broker.json                     the broker's state (drmas/broker/checkpoint.py)

Who writes: learner ranks (drmas/learners/checkpoint.py) and the broker. Who reads: the
broker on resume (to choose each model's version), learners on resume (to load it), the
launcher (to name the checkpoint to resume from when a learner dies).

A save goes into `.tmp-step-N`; rank 0 writes the manifest after every rank's files are
on disk, then renames the folder to `step-N`. A folder is complete only when its name is
`step-N` AND it holds a manifest that names its files: a crash at any point leaves either
no `step-N` or an incomplete one that every reader ignores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
BROKER_STATE = "broker.json"
_STEP = re.compile(r"^step-(\d{6,})$")
_SET_ASIDE = ".set-aside-"
FORMAT = "drmas-safetensors-1"
"""The learner checkpoint format this drmas writes and reads (drmas/checkpoints/tensors.py)."""
PICKLED_SUFFIXES = (".metadata", ".distcp", ".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
"""Files of formats read with pickle (DCP, torch.save, pickle): never read from a checkpoint."""
REDO = "resume from another checkpoint of the run, or start the run again without run.resume"


class CheckpointError(ValueError):
    """A checkpoint folder this drmas will not read; the message says why and what to do."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete learner checkpoint."""

    model: str
    version: int
    world_size: int
    path: Path


def root_for(run_dir: str | Path, checkpoint_dir: str = "") -> Path:
    """Where a run's checkpoints live: `checkpoint.dir`, else RUN_DIR/checkpoints."""
    return Path(checkpoint_dir) if checkpoint_dir else Path(run_dir) / "checkpoints"


def step_name(version: int) -> str:
    return f"step-{version:06d}"


def tmp_name(version: int) -> str:
    return f".tmp-{step_name(version)}"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` so that a reader sees the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest when the folder is complete (every listed file present), else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return None
    for name, size in manifest["files"].items():
        try:
            if (folder / name).stat().st_size != size:
                return None
        except OSError:
            return None
    return manifest


def check_format(folder: Path, manifest: dict[str, Any] | None) -> int:
    """The world size of the complete checkpoint `folder` (its `manifest`), after checking
    it is in this format. An older drmas's checkpoint (torch.distributed.checkpoint files)
    is refused without opening any of its files."""
    if manifest is None:
        raise CheckpointError(f"{folder} is not a complete checkpoint (no valid manifest); {REDO}")
    if manifest.get("format") != FORMAT:
        legacy = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLED_SUFFIXES))
        what = f"torch.distributed.checkpoint / torch.save files {legacy}" if legacy else "files"
        raise CheckpointError(
            f"{folder} holds {what} in format {manifest.get('format')!r}, not {FORMAT!r}. "
            "Checkpoints of drmas before this version were read with pickle, which runs "
            f"code that the files name, so this drmas does not read them: {REDO}"
        )
    world = manifest.get("world_size")
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{folder}: manifest world_size {world!r} is not a rank count")
    return world


def complete(model_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of one model, oldest first."""
    found: list[Checkpoint] = []
    if not model_dir.is_dir():
        return found
    for folder in model_dir.iterdir():
        match = _STEP.match(folder.name)
        if not match or not folder.is_dir():
            continue
        manifest = read_manifest(folder)
        if manifest is None or int(manifest.get("version", -1)) != int(match.group(1)):
            continue
        found.append(
            Checkpoint(
                model_dir.name, int(manifest["version"]), int(manifest["world_size"]), folder
            )
        )
    return sorted(found, key=lambda c: c.version)


def latest(model_dir: Path, at_most: int | None = None) -> Checkpoint | None:
    """The newest complete checkpoint (with version <= at_most when given)."""
    usable = [c for c in complete(model_dir) if at_most is None or c.version <= at_most]
    return usable[-1] if usable else None


def find(model_dir: Path, version: int) -> Checkpoint | None:
    return next((c for c in complete(model_dir) if c.version == version), None)


def begin(model_dir: Path, version: int) -> Path:
    """An empty temporary folder for the save of `version` (a leftover of a crash is removed)."""
    tmp = model_dir / tmp_name(version)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, version: int, world_size: int, extra: dict[str, Any] | None = None) -> Path:
    """Rank 0, after every rank's files are in `tmp`: write the manifest last, then rename
    the folder to its final name. Returns the final folder."""
    files = {
        p.name: p.stat().st_size
        for p in sorted(tmp.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    for name in files:  # the data must be on disk before the manifest says it is
        _fsync_file(tmp / name)
    manifest = {
        "version": version,
        "world_size": world_size,
        "time": time.time(),
        "files": files,
        **(extra or {}),
    }
    write_json_atomic(tmp / MANIFEST, manifest)
    final = tmp.parent / step_name(version)
    if final.exists():  # a checkpoint of an abandoned history (see set_aside)
        set_aside(final, "replaced")
    os.rename(tmp, final)
    _fsync_dir(tmp.parent)
    return final


def rotate(model_dir: Path, keep: int) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep`, temporary folders of saves
    older than the newest complete one (crashed saves) and folders set aside. Returns what
    was deleted."""
    done = complete(model_dir)
    deleted = [c.path for c in done[: max(len(done) - max(keep, 1), 0)]]
    newest = done[-1].version if done else -1
    for folder in model_dir.iterdir() if model_dir.is_dir() else []:
        match = re.match(r"^\.tmp-step-(\d+)$", folder.name)
        if (match and int(match.group(1)) <= newest) or folder.name.startswith(_SET_ASIDE):
            deleted.append(folder)
    for path in deleted:
        shutil.rmtree(path, ignore_errors=True)
    return deleted


def set_aside(folder: Path, why: str) -> Path:
    """Rename a checkpoint so that no reader takes it (e.g. newer than the version a resumed
    run continues from: it belongs to a history that resume abandoned)."""
    target = folder.with_name(f"{_SET_ASIDE}{why}-{folder.name}-{time.time_ns()}")
    os.rename(folder, target)
    return target


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems do not fsync directories
    finally:
        os.close(fd)
