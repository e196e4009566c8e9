"""A planted pickle payload in any file a resume (or `drmas eval --step`) reads runs nothing.

The payload is a __reduce__ that writes a marker file: unpickling it (pickle.load, or
torch.load(weights_only=False) of a torch.save'd one, as DCP's reader does) writes the
marker, which the first test shows. Then each file of a real one-rank learner checkpoint
(drmas/learners/checkpoint.py) and the broker's broker.json is replaced by the payload,
with the manifest's sizes made to match as an attacker who can write the folder would;
the learner's load, eval's export and the broker's read refuse it with a message that
says what to do, and the marker is never written. An older drmas's DCP checkpoint
(`.metadata`, `.distcp`, `rng-rank0.pt`) is refused without opening those files.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from drmas.broker import checkpoint as broker_checkpoint
from drmas.checkpoints import store
from drmas.checkpoints.store import CheckpointError
from drmas.checkpoints.tensors import full_tensors, layout_name, tensors_name
from drmas.launch.evaluate import EvalError, export_checkpoint
from tests.integration.test_fsdp_learner import MODEL, make_config, make_samples, shards, tiny_qwen2
from tests.rendezvous import gloo_init

LEARNER_FILES = [store.MANIFEST, layout_name(0), tensors_name(0)]


class Payload:
    """Unpickling this writes `marker`: the code an attacker would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return exec, (f"open({str(self.marker)!r}, 'w').write('payload ran')",)


def raw_pickle(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def torch_saved(marker: Path) -> bytes:
    out = io.BytesIO()
    torch.save({"state": Payload(marker)}, out)
    return out.getvalue()


PAYLOADS = {"pickle": raw_pickle, "torch.save": torch_saved}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Path]]:
    """(config, a one-rank learner after one step, its checkpoint at v1), in a gloo group
    that lives as long as the module's tests."""
    import torch.distributed as dist

    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer

    tmp = tmp_path_factory.mktemp("ckpt")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=gloo_init(), rank=0, world_size=1)
    try:
        cfg = make_config(tiny_qwen2(tmp / "hf"))
        trainer = Trainer(cfg, MODEL, 0, 1, "cpu")
        trainer.step(shards(make_samples(), 1)[0])
        folder = ckpt.save(trainer, tmp / "ckpt" / MODEL, 1, keep=2)
        yield cfg, trainer, folder
    finally:
        dist.destroy_process_group()


def copy_of(folder: Path, tmp_path: Path) -> Path:
    """The checkpoint at the same place in a model folder of its own (step-000001)."""
    target = tmp_path / "ckpt" / MODEL / folder.name
    shutil.copytree(folder, target)
    return target


def plant(folder: Path, name: str, payload: bytes) -> None:
    """Replace `name` by `payload` and, unless it is the manifest itself, make the
    manifest's sizes match, so the folder still counts as complete."""
    (folder / name).write_bytes(payload)
    if name == store.MANIFEST:
        return
    manifest = json.loads((folder / store.MANIFEST).read_text())
    manifest["files"] = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    del manifest["files"][store.MANIFEST]
    store.write_json_atomic(folder / store.MANIFEST, manifest)
    assert store.read_manifest(folder) is not None


def resume(trainer: Any, folder: Path) -> str:
    from drmas.learners import checkpoint as ckpt

    return ckpt.load(trainer, store.Checkpoint(MODEL, 1, 1, folder))


def test_the_payloads_run_when_unpickled(tmp_path: Path) -> None:
    """The payloads are live: what DCP and torch.save's readers do runs them."""
    for kind, make in PAYLOADS.items():
        marker = tmp_path / f"ran-{kind}"
        data = make(marker)
        if kind == "pickle":
            pickle.loads(data)  # DCP reads .metadata like this
        else:
            torch.load(io.BytesIO(data), weights_only=False)  # and its non-tensor items
        assert marker.read_text() == "payload ran"


def test_an_untouched_copy_resumes(saved: tuple[Any, Any, Path], tmp_path: Path) -> None:
    """The control: the refusals below are the payload's, not the copy's."""
    _, trainer, folder = saved
    copy = copy_of(folder, tmp_path)
    assert resume(trainer, copy) == store.read_manifest(folder)["optim_digests"][0]  # type: ignore[index]
    joined = full_tensors(copy, lambda key: key.startswith("model/"))  # as eval reads it
    for name, tensor in trainer.full_state_dict_iter():
        assert torch.equal(joined[f"model/{name}"], tensor), name


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
@pytest.mark.parametrize("name", LEARNER_FILES)
def test_a_payload_in_a_learner_file_runs_nothing(
    saved: tuple[Any, Any, Path], tmp_path: Path, name: str, kind: str
) -> None:
    cfg, trainer, folder = saved
    marker = tmp_path / "ran"
    copy = copy_of(folder, tmp_path)
    plant(copy, name, PAYLOADS[kind](marker))
    if name == store.MANIFEST:  # not JSON: the folder is not a complete checkpoint
        assert store.find(copy.parent, 1) is None
    else:
        assert store.find(copy.parent, 1) is not None
    expected = "resume from another checkpoint|not a complete checkpoint"
    with pytest.raises(CheckpointError, match=expected):
        resume(trainer, copy)
    with pytest.raises(CheckpointError, match=expected):  # drmas eval --step
        export_checkpoint(cfg, MODEL, copy)
    assert not marker.exists()


def test_an_older_dcp_checkpoint_is_refused_unopened(
    saved: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    """What drmas wrote before: DCP files, RNG by torch.save, a manifest without format."""
    cfg, trainer, _ = saved
    marker = tmp_path / "ran"
    folder = store.begin(tmp_path / "ckpt" / MODEL, 1)
    (folder / ".metadata").write_bytes(raw_pickle(marker))
    (folder / "__0_0.distcp").write_bytes(torch_saved(marker))
    (folder / "rng-rank0.pt").write_bytes(torch_saved(marker))
    folder = store.commit(folder, 1, world_size=1, extra={"model": MODEL})
    with pytest.raises(CheckpointError, match=r"read with pickle.*do(es)? not read them"):
        resume(trainer, folder)
    with pytest.raises(CheckpointError, match="read with pickle"):
        full_tensors(folder, lambda key: True)
    with pytest.raises(CheckpointError, match="read with pickle"):
        export_checkpoint(cfg, MODEL, folder)
    snap = {"versions": {MODEL: 1}, "covered": {MODEL: 0}}  # the broker, before any learner
    with pytest.raises(CheckpointError, match="read with pickle"):
        broker_checkpoint.choose_versions(snap, tmp_path / "ckpt", [MODEL])
    assert not marker.exists()


@pytest.mark.parametrize("export", ["hf", "adapters/a"])
def test_a_payload_in_an_earlier_export_runs_nothing(
    saved: tuple[Any, Any, Path], tmp_path: Path, export: str
) -> None:
    """`drmas eval --step` uses an export it wrote before into the checkpoint folder (hf/,
    adapters/<a>/); a planted one with pickle-format weights is refused before any engine
    loads it."""
    from drmas.launch.evaluate import export_checkpoint_adapters

    cfg, _, folder = saved
    marker = tmp_path / "ran"
    copy = copy_of(folder, tmp_path)
    planted = copy / export
    planted.mkdir(parents=True)
    (planted / "config.json").write_text("{}")
    (planted / "adapter_config.json").write_text("{}")
    (planted / "pytorch_model.bin").write_bytes(torch_saved(marker))
    export_of = export_checkpoint if export == "hf" else export_checkpoint_adapters
    with pytest.raises(EvalError, match="not written by drmas; delete"):
        export_of(cfg, MODEL, copy)
    assert not marker.exists()


def test_a_payload_in_the_broker_state_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for kind, make in PAYLOADS.items():
        path = tmp_path / kind / store.BROKER_STATE
        path.parent.mkdir()
        path.write_bytes(make(marker))
        with pytest.raises(ValueError, match=r"is not the broker's JSON.*resume from a run folder"):
            broker_checkpoint.read_snapshot(path)
    assert not marker.exists()


def test_a_shard_at_the_wrong_place_is_refused(
    saved: tuple[Any, Any, Path], tmp_path: Path
) -> None:
    """Valid files whose layout does not match the learner's shards: refused, not copied."""
    _, trainer, folder = saved
    copy = copy_of(folder, tmp_path)
    doc = json.loads((copy / layout_name(0)).read_text())
    key = next(k for k, v in doc["layout"].items() if k.startswith("model/") and v["shape"])
    doc["layout"][key]["shape"][0] += 1
    plant(copy, layout_name(0), json.dumps(doc).encode())
    with pytest.raises(CheckpointError, match=f"{key} is saved as .*own config.yaml"):
        resume(trainer, copy)
