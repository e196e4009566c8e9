"""Checkpoints: atomic folders and rotation, the broker's snapshot/restore, the task cursor,
and a learner's save/load (safetensors + JSON; one gloo rank in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drmas.broker import checkpoint as broker_checkpoint
from drmas.broker.state import BrokerState
from drmas.broker.status import lease_accounting
from drmas.checkpoints import store
from drmas.config import load_config
from drmas.config.task import TaskConfig
from drmas.protocol import pack_ids, pack_logprobs
from drmas.protocol.messages import Episode, GroupResult, Step, pack_group
from drmas.tasks.source import TaskSource
from tests.fixtures.holding import hold
from tests.rendezvous import gloo_init


# ---------------------------------------------------------------------- folders
def fake_checkpoint(model_dir: Path, version: int, *, manifest: bool = True) -> Path:
    tmp = store.begin(model_dir, version)
    (tmp / "rank-00000.safetensors").write_bytes(b"x" * (10 + version))
    (tmp / "rank-00000.json").write_bytes(b"meta")
    if not manifest:  # a crash before the manifest: the folder stays a temporary one
        return tmp
    return store.commit(tmp, version, world_size=1, extra={"format": store.FORMAT})


def test_only_folders_with_a_complete_manifest_count(tmp_path: Path) -> None:
    model_dir = tmp_path / "solver"
    fake_checkpoint(model_dir, 2)
    fake_checkpoint(model_dir, 4, manifest=False)  # crashed save: .tmp-step-000004
    no_manifest = model_dir / store.step_name(6)  # a step folder without manifest
    no_manifest.mkdir()
    (no_manifest / "rank-00000.safetensors").write_bytes(b"x")
    truncated = fake_checkpoint(model_dir, 8)
    (truncated / "rank-00000.safetensors").write_bytes(b"x")  # a listed file with the wrong size
    assert [c.version for c in store.complete(model_dir)] == [2]
    assert store.latest(model_dir).version == 2  # type: ignore[union-attr]
    assert store.find(model_dir, 4) is None and store.find(model_dir, 6) is None
    manifest = json.loads((model_dir / "step-000002" / store.MANIFEST).read_text())
    assert manifest["version"] == 2 and manifest["world_size"] == 1
    assert manifest["files"] == {"rank-00000.json": 4, "rank-00000.safetensors": 12}


def test_rotation_keeps_the_newest_n_and_clears_crashed_saves(tmp_path: Path) -> None:
    model_dir = tmp_path / "solver"
    for v in (2, 4):
        fake_checkpoint(model_dir, v)
    fake_checkpoint(model_dir, 3, manifest=False)  # older than the newest complete: garbage
    fake_checkpoint(model_dir, 8, manifest=False)  # may still be in progress: kept
    fake_checkpoint(model_dir, 6)
    deleted = store.rotate(model_dir, keep=2)
    assert sorted(p.name for p in deleted) == [".tmp-step-000003", "step-000002"]
    assert [c.version for c in store.complete(model_dir)] == [4, 6]
    assert (model_dir / ".tmp-step-000008").exists()
    assert store.latest(model_dir, at_most=5).version == 4  # type: ignore[union-attr]


def test_commit_replaces_a_checkpoint_of_an_abandoned_history(tmp_path: Path) -> None:
    model_dir = tmp_path / "solver"
    fake_checkpoint(model_dir, 4)
    again = fake_checkpoint(model_dir, 4)
    assert [c.path for c in store.complete(model_dir)] == [again]
    assert [
        p.name.startswith(".set-aside-replaced-step-000004") for p in store.rotate(model_dir, 2)
    ] == [True]


# ---------------------------------------------------------------------- task source
def test_task_cursor_continues_exactly_across_epochs_and_requeues() -> None:
    cfg = TaskConfig(num_train=5, num_val=2, seed=3)
    a = TaskSource(cfg)
    seen = [a.next_task() for _ in range(7)]  # into the second epoch
    a.requeue(seen[1])
    a.requeue(seen[6])
    saved = json.loads(json.dumps(a.state()))  # what goes to disk
    expected = [a.next_task().task_id for _ in range(12)]
    b = TaskSource(cfg)
    b.load_state(saved)
    assert [b.next_task().task_id for _ in range(12)] == expected
    assert expected[:2] == [seen[6].task_id, seen[1].task_id]
    assert saved["epoch"] == 1 and saved["index"] == 2


# ---------------------------------------------------------------------- broker state
def make_state(*overrides: str) -> BrokerState:
    cfg = load_config(
        ["group_size=2", "batch_groups=2", "train.steps=6", "val.every=4", "val.num_tasks=3",
         "val.n=2", "val.k=2", "checkpoint.every=2", *overrides]
    )  # fmt: skip
    return BrokerState(cfg, TaskSource(cfg.task))


def result(lease, version: int, actor: str = "a") -> GroupResult:
    def step(agent: str) -> Step:
        return Step(agent, agent, pack_ids([1, 2]), pack_ids([3]), pack_logprobs([-0.5]),
                    version, True, "stop")  # fmt: skip

    episodes = [Episode([step("solver"), step("verifier")], r) for r in (1.0, 0.0)]
    return pack_group(actor, lease.lease_id, lease.group_id, episodes)


def train_one_step(st: BrokerState, version: int) -> list[str]:
    """Lease B groups, accept them, cut and train one batch per model; returns task ids."""
    hold(st, "a", solver=version, verifier=version)
    leases = st.lease("a", 2, {"solver": version, "verifier": version}, 0.0).leases
    assert len(leases) == 2
    for lease in leases:
        assert st.accept("a", result(lease, version), 0.0) == ""
    for model in ("solver", "verifier"):
        st.batch(model, 0, 1, version, 0.0)
        st.step_report(model, version + 1, {})
    return [lease.task.task_id for lease in leases]


def test_broker_snapshot_restore_round_trip(tmp_path: Path) -> None:
    st = make_state()
    st.add_actor("a", "h", 1, ["solver", "verifier"], 0.0)
    val_leases = st.lease("a", 3, {"solver": 0, "verifier": 0}, 0.0).leases  # step-0 round
    assert all(lease.is_eval for lease in val_leases)
    st.accept("a", result(val_leases[0], 0), 0.0)  # one validation task done, two in flight
    trained = [t for v in range(2) for t in train_one_step(st, v)]  # v2 = the checkpoint
    for model in ("solver", "verifier"):
        fake_checkpoint(tmp_path / model, 2)  # the learners' complete checkpoints at v2
    after = train_one_step(st, 2)  # solver and verifier train v3: not in their checkpoints
    hold(st, "a", solver=3, verifier=3)
    buffered = st.lease("a", 2, {"solver": 3, "verifier": 3}, 0.0).leases
    st.accept("a", result(buffered[0], 3), 0.0)  # buffered, not trained
    in_flight = [buffered[1].task.task_id]
    probe = TaskSource(st.cfg.task)
    probe.load_state(st.source.state())
    future = [probe.next_task().task_id for _ in range(3)]  # what the cursor gives next
    snap = json.loads(json.dumps(broker_checkpoint.snapshot(st, tmp_path)))
    assert snap["versions"] == {"solver": 3, "verifier": 3}
    assert snap["covered"] == {"solver": 2, "verifier": 2}
    assert len(snap["trained_log"]) == 4  # the two v3 groups of each model

    versions = broker_checkpoint.choose_versions(snap, tmp_path, ["solver", "verifier"])
    assert versions == {"solver": 2, "verifier": 2}
    fresh = make_state()
    fresh.restore(snap, versions)
    assert fresh.versions == versions
    assert {m: b.batches_cut for m, b in fresh.buffers.items()} == versions
    # what v3 trained, what was buffered and what was in flight comes back first, in group
    # order; then the cursor goes on exactly where it was
    requeued = [*after, buffered[0].task.task_id, *in_flight]
    served = [fresh.source.next_task().task_id for _ in range(len(requeued) + 3)]
    assert served == requeued + future
    assert not set(served) & set(trained)  # nothing the checkpoints hold comes again
    for model in ("solver", "verifier"):
        assert len(fresh.trained_groups[model]) == 4  # groups of v1 and v2 only
    next_group = fresh.table.snapshot()["next_group"]
    assert next_group == st.table.snapshot()["next_group"]  # new groups get new ids
    assert fresh.counters["leases_issued"] == st.counters["leases_issued"]
    assert fresh.counters["leases_requeued_on_resume"] == 3  # 2 validation + 1 training
    assert lease_accounting(fresh)["balanced"] == 1
    val = fresh.validation
    assert [t.task_id for t, s in val.queue] == [x.task.task_id for x in val_leases[1:]]
    assert val.scheduled == {0} and len(val.rounds[0].successes) == 1
    assert set(range(3)) <= fresh.metrics.flushed  # a re-publish of v2 is not a new line


def test_resume_prefers_checkpoints_the_broker_state_knows(tmp_path: Path) -> None:
    snap = {"versions": {"solver": 4, "verifier": 3}, "covered": {"solver": 2, "verifier": 0}}
    for v in (2, 4, 6):  # v6 completed after the snapshot: its trained groups are unknown
        fake_checkpoint(tmp_path / "solver", v)
    chosen = broker_checkpoint.choose_versions(snap, tmp_path, ["solver", "verifier"])
    assert chosen == {"solver": 4, "verifier": 0}
    snap["covered"]["solver"] = 5
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of solver"):
        broker_checkpoint.choose_versions(snap, tmp_path, ["solver", "verifier"])


def test_rewind_moves_later_metrics_lines_aside(tmp_path: Path) -> None:
    lines = [{"step": s, "x": s} for s in (1, 2, 0, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    broker_checkpoint.rewind_metrics(tmp_path, 2)
    kept = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    moved = (tmp_path / "metrics.rewound.jsonl").read_text().splitlines()
    assert kept == [1, 2, 0] and [json.loads(x)["step"] for x in moved] == [3, 4]


# ---------------------------------------------------------------------- learner files
def test_learner_checkpoint_restores_model_optimizer_and_rng(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer
    from tests.integration.test_fsdp_learner import (
        MODEL,
        make_config,
        make_samples,
        shards,
        tiny_qwen2,
    )

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    dist.init_process_group("gloo", init_method=gloo_init(), rank=0, world_size=1)
    try:
        cfg = make_config(tiny_qwen2(tmp_path / "hf"))
        a = Trainer(cfg, MODEL, 0, 1, "cpu")
        a.step(shards(make_samples(), 1)[0])
        folder = ckpt.save(a, tmp_path / "ckpt" / MODEL, 1, keep=2)
        manifest = store.read_manifest(folder)
        assert manifest is not None and manifest["version"] == 1
        expected_rand = torch.rand(4)  # what the RNG gives right after the save
        a.step(shards(make_samples(), 1)[0])  # a moves on; the checkpoint must not

        b = Trainer(cfg, MODEL, 0, 1, "cpu")
        checkpoint = store.find(tmp_path / "ckpt" / MODEL, 1)
        assert checkpoint is not None
        digest = ckpt.load(b, checkpoint)
        assert digest == manifest["optim_digests"][0]
        assert torch.equal(torch.rand(4), expected_rand)
        c = Trainer(cfg, MODEL, 0, 1, "cpu")  # a second copy, stepped once like `a` was
        c.step(shards(make_samples(), 1)[0])
        for (name, p_b), (_, p_c) in zip(b.full_state_dict_iter(), c.full_state_dict_iter()):
            assert torch.equal(p_b, p_c), name
        for p_b, p_c in zip(b.model.parameters(), c.model.parameters()):
            sb, sc = b.optimizer.state[p_b], c.optimizer.state[p_c]
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(full(sb[key]), full(sc[key])), key
    finally:
        dist.destroy_process_group()


def _two_rank_worker(rank: int, init: str, folder: str) -> None:
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer, _local
    from tests.integration.test_fsdp_learner import MODEL, make_config, make_samples, shards

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        cfg = make_config(Path(folder) / "hf")
        a = Trainer(cfg, MODEL, rank, 2, "cpu")
        a.step(shards(make_samples(), 2)[rank])
        ckpt.save(a, Path(folder) / "ckpt" / MODEL, 1, keep=2)
        full = dict(a.full_state_dict_iter())  # a collective: every rank gathers
        if rank == 0:
            save_file(full, Path(folder) / "full.safetensors")
        params = [_local(p.detach()).clone() for p in a.model.parameters()]
        optim = [
            {k: _local(v).clone() for k, v in a.optimizer.state[p].items()}
            for p in a.model.parameters()
        ]
        expected_rand = torch.rand(3)
        b = Trainer(cfg, MODEL, rank, 2, "cpu")
        checkpoint = store.find(Path(folder) / "ckpt" / MODEL, 1)
        assert checkpoint is not None and checkpoint.world_size == 2
        ckpt.load(b, checkpoint)
        assert torch.equal(torch.rand(3), expected_rand)  # this rank's own RNG stream
        for p, saved_p, saved_o in zip(b.model.parameters(), params, optim):
            assert torch.equal(_local(p.detach()), saved_p)
            for key, value in saved_o.items():
                assert torch.equal(_local(b.optimizer.state[p][key]), value), key
        (Path(folder) / f"ok-{rank}").write_text("ok")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_learner_checkpoint_restores_every_shard(tmp_path: Path) -> None:
    mp = pytest.importorskip("torch.multiprocessing")
    from tests.integration.test_fsdp_learner import tiny_qwen2

    tiny_qwen2(tmp_path / "hf")
    mp.spawn(_two_rank_worker, args=(gloo_init(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "ok-0").exists() and (tmp_path / "ok-1").exists()
    manifest = store.read_manifest(tmp_path / "ckpt" / "policy" / "step-000001")
    assert manifest is not None and sorted(manifest["files"]) == [
        "rank-00000.json", "rank-00000.safetensors", "rank-00001.json", "rank-00001.safetensors"
    ]  # fmt: skip
    # Without a process group (drmas eval --step): both ranks' shards make the full tensors.
    import torch
    from safetensors.torch import load_file

    from drmas.checkpoints.tensors import full_tensors
    from drmas.learners.model_io import hf_name

    expected = load_file(tmp_path / "full.safetensors")
    joined = full_tensors(
        tmp_path / "ckpt" / "policy" / "step-000001", lambda k: k.startswith("model/")
    )
    by_name = {hf_name(k.removeprefix("model/")): t for k, t in joined.items()}
    assert expected.keys() <= by_name.keys() and len(expected) > 1
    for name, tensor in expected.items():
        assert torch.equal(by_name[name], tensor), name


def test_rng_state_round_trips_without_pickle(tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from drmas.learners.checkpoint import rng_state, set_rng_state

    cpu = torch.device("cpu")
    random.gauss(0, 1)  # a cached gaussian is part of the state too
    tensors, numbers = rng_state(cpu)
    save_file(tensors, tmp_path / "rng.safetensors")  # tensors: raw bytes
    (tmp_path / "rng.json").write_text(json.dumps(numbers))  # the rest: JSON numbers
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    loaded = load_file(tmp_path / "rng.safetensors")
    set_rng_state(loaded, json.loads((tmp_path / "rng.json").read_text()), cpu)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_models_resumed_at_different_versions_get_every_step_line_again(tmp_path: Path) -> None:
    """Solver resumed at v2, Verifier at v0 (no checkpoint of its own yet): lines 1 and 2
    were moved to metrics.rewound.jsonl, so each is written again once the Verifier
    reports it; the Solver, already past them, counts as reported (a loaded CI machine
    hit this: the lines were lost)."""
    from drmas.broker.metrics import StepMetrics

    class Sink:
        def __init__(self) -> None:
            self.lines: list[dict] = []

        def write(self, record: dict) -> None:
            self.lines.append(record)

        def close(self) -> None:
            pass

    st = make_state()
    sink = Sink()
    st.metrics = StepMetrics(sink, ["solver", "verifier"])  # type: ignore[arg-type]
    snap = json.loads(json.dumps(broker_checkpoint.snapshot(st, tmp_path)))
    st.restore(snap, {"solver": 2, "verifier": 0})
    assert st.metrics.flushed == {0}
    st.metrics.report(2, "solver", "publish", {}, {})  # its re-sync publish: no line
    for step in (1, 2, 3):
        st.metrics.report(step, "verifier", "step", {"loss/verifier": 1.0}, {})
        st.metrics.report(step, "verifier", "publish", {}, {})
    assert [line["step"] for line in sink.lines] == [1, 2]  # 3 waits for the solver too


def _header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header length and header (names, dtypes, byte offsets)."""
    import struct

    with path.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return length, json.loads(f.read(length))


def _poison_file(path: Path, key: str, value: float) -> None:
    """Overwrite the first element of tensor `key` in a safetensors file in place (the
    file's size kept): what a bit flip or a hostile edit on disk does."""
    import struct

    size = path.stat().st_size
    length, header = _header(path)
    assert header[key]["dtype"] == "F32"
    with path.open("r+b") as f:
        f.seek(8 + length + header[key]["data_offsets"][0])
        f.write(struct.pack("<f", value))
    assert path.stat().st_size == size


@pytest.mark.parametrize("digest", [True, False])
def test_a_damaged_checkpoint_is_refused_naming_its_file_and_the_last_good_one(
    tmp_path: Path, digest: bool
) -> None:
    """A NaN written into a checkpoint's weights used to load silently and go out to the
    actors. It is refused by the weights digest the manifest records (digest=True) and,
    for a checkpoint saved without one, by the finiteness check (digest=False)."""
    pytest.importorskip("torch")
    import torch.distributed as dist

    from drmas.checkpoints.tensors import tensors_name
    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer
    from tests.integration.test_fsdp_learner import MODEL, make_config, tiny_qwen2

    dist.init_process_group("gloo", init_method=gloo_init(), rank=0, world_size=1)
    try:
        cfg = make_config(tiny_qwen2(tmp_path / "hf"))
        a = Trainer(cfg, MODEL, 0, 1, "cpu")
        model_dir = tmp_path / "ckpt" / MODEL
        first = ckpt.save(a, model_dir, 1, keep=3)
        second = ckpt.save(a, model_dir, 2, keep=3)
        manifest = store.read_manifest(second)
        assert manifest is not None and len(manifest["weights_digests"]) == 1
        if not digest:  # as a checkpoint of an older drmas: no digest to compare
            manifest.pop("weights_digests")
            (second / "manifest.json").write_text(json.dumps(manifest))
        file = second / tensors_name(0)
        key = next(
            k
            for k in json.loads(
                file.read_bytes()[8:][: int.from_bytes(file.read_bytes()[:8], "little")]
            )
            if k.startswith("model/") and "mlp" in k
        )
        _poison_file(file, key, float("nan"))
        b = Trainer(cfg, MODEL, 0, 1, "cpu")
        checkpoint = store.find(model_dir, 2)
        assert checkpoint is not None
        with pytest.raises(store.CheckpointError) as err:
            ckpt.load(b, checkpoint)
        text = str(err.value)
        assert str(file) in text
        assert ("differ from the digest" in text) == digest
        assert digest or f"NaN or inf in {key}" in text
        assert f"{first} (v1)" in text and f"mv {second} " in text
        assert b.non_finite() == []  # nothing of it was copied into the model
        ckpt.load(b, store.find(model_dir, 1))  # the good one loads
    finally:
        dist.destroy_process_group()
