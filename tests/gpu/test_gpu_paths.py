"""NCCL paths that need two GPUs (marker `gpu`; run by scripts/gpu_check.sh, skipped
elsewhere): NCCL FSDP learner ranks (2 ranks = 1 rank), and an NCCL weight broadcast from
a learner to an actor process compared bit for bit. NCCL cannot put two ranks of one
communicator on the same GPU, so on the one-GPU machine both say so when skipped.
Timings are printed (run with -s), never asserted."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from drmas.config.transport import WeightSyncConfig
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.weights import WeightReceiver, WeightSender
from tests.integration.test_fsdp_learner import (
    MODEL,
    free_port,
    make_config,
    make_samples,
    shards,
    tiny_qwen2,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(180),
]
two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank: this check needs 2 GPUs"
)


def nccl_train_worker(rank: int, world: int, port: int, cfg, shard_list, out: str) -> None:
    import torch.distributed as dist

    from drmas.learners.trainer import Trainer

    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        trainer = Trainer(cfg, MODEL, rank, world, torch.device("cuda", rank))
        start = time.perf_counter()
        metrics = trainer.step(shard_list[rank])
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        after = {n: t.cpu() for n, t in trainer.full_state_dict_iter()}
        if rank == 0:
            torch.save({"metrics": metrics, "after": after, "seconds": seconds}, out)
    finally:
        dist.destroy_process_group()


def run_world(world: int, cfg, shard_list, out: Path) -> dict:
    mp.spawn(nccl_train_worker, args=(world, free_port(), cfg, shard_list, str(out)), nprocs=world)
    return torch.load(out, weights_only=False)


@two_gpus
def test_nccl_fsdp_two_ranks_match_one_rank(tmp_path: Path) -> None:
    cfg = make_config(tiny_qwen2(tmp_path / "model"))
    cfg.learner.device = "cuda"
    samples = make_samples()
    one = run_world(1, cfg, shards(samples, 1), tmp_path / "one.pt")
    two = run_world(2, cfg, shards(samples, 2), tmp_path / "two.pt")
    print(f"\nNCCL FSDP step: 1 rank {one['seconds']:.3f} s, 2 ranks {two['seconds']:.3f} s")
    for name, tensor in one["after"].items():
        torch.testing.assert_close(two["after"][name], tensor, atol=1e-5, rtol=1e-4)
    assert abs(one["metrics"]["grad_norm/" + MODEL] - two["metrics"]["grad_norm/" + MODEL]) < 1e-4


def nccl_receive_worker(join: JoinWeightGroup, out: str) -> None:
    torch.cuda.set_device(1)
    receiver = WeightReceiver(WeightSyncConfig(), torch.device("cuda", 1))
    state: dict[str, torch.Tensor] = {}

    def load(batch) -> None:
        state.update((name, t.cpu().clone()) for name, t in batch)

    start = time.perf_counter()
    stats = receiver.receive_into(join, load)
    torch.save({"state": state, "seconds": time.perf_counter() - start, "bytes": stats.bytes}, out)


@two_gpus
def test_nccl_weight_broadcast_is_bit_identical(tmp_path: Path) -> None:
    from tests.integration.test_weight_sync import tiny_state

    torch.cuda.set_device(0)
    state = [(n, t.cuda(0)) for n, t in tiny_state()]
    sender = WeightSender(WeightSyncConfig(backend="nccl"), torch.device("cuda", 0))
    join = JoinWeightGroup("m", 1, "m-v1", sender.store_address, 1, 2, 60.0)
    proc = multiprocessing.get_context("spawn").Process(
        target=nccl_receive_worker, args=(join, str(tmp_path / "r.pt"))
    )
    proc.start()
    try:
        start = time.perf_counter()
        stats = sender.publish("m-v1", 1, state, 60.0)
        seconds = time.perf_counter() - start
        proc.join(120)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    got = torch.load(tmp_path / "r.pt", weights_only=False)
    print(
        f"\nNCCL publish of {stats.bytes / 2**20:.1f} MiB: send {seconds:.3f} s, "
        f"receive {got['seconds']:.3f} s"
    )
    for name, tensor in state:
        assert torch.equal(got["state"][name], tensor.cpu()), name
