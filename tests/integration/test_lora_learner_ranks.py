"""The learner on a LoRA base across ranks: FSDP2 shards the frozen base and the adapters,
two ranks train like one, an adapter without steps stays bit-identical also when a rank
runs only padding micro-batches for it, checkpoints restore every shard, and the learner
process publishes only the adapters and exports the base plus one PEFT folder each.

Real processes (torch.multiprocessing spawn, gloo), the tiny Qwen2 and the lopsided
solver/verifier shards of test_fsdp_learner.py, with models.policy.lora.rank=4: two
adapters, "solver" and "verifier". Both ranks count the same adapter versions, and the
learner process sends only the adapters the broker's plan names, with the digest of both.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import pytest
import torch
import torch.multiprocessing as mp

from drmas.protocol.messages import (
    BatchRequest,
    BatchShard,
    PublishDone,
    PublishRequest,
    StepReport,
    WeightGroupPlan,
)
from drmas.transports.ports import free_port
from tests.fixtures.ranks import leave
from tests.integration.test_fsdp_learner import (
    MODEL,
    FakeBroker,
    learner_worker,
    make_config,
    make_samples,
    shards,
    tiny_qwen2,
)
from tests.rendezvous import gloo_init

if TYPE_CHECKING:
    from drmas.learners.trainer import Trainer

pytestmark = pytest.mark.slow


def lora_config(model_dir: Path):  # -> DrmasConfig
    cfg = make_config(model_dir)
    cfg.models[MODEL].lora.rank = 4
    # The KL term on: its reference is the sharded base with the adapters off, one more
    # no-grad forward through FSDP2 between each micro-batch's forward and backward.
    cfg.algorithm.loss.kl_coef = 0.05
    return cfg


def verifier_only(world_size: int) -> list[BatchShard]:
    """The verifier's 3 samples alone; on 2 ranks rank 0 has 2, rank 1 has 1 and a
    zero-weight padding copy."""
    verifier = make_samples()[4:]
    totals = {
        "total_samples": len(verifier),
        "total_tokens": sum(len(s.response_ids) // 4 for s in verifier),
    }
    parts = [(verifier, [1.0] * 3)] if world_size == 1 else [
        (verifier[:2], [1.0, 1.0]),
        (verifier[2:] + verifier[:1], [1.0, 0.0]),
    ]  # fmt: skip
    return [
        BatchShard(MODEL, 0, rank, world_size, list(ss), list(ws), **totals)
        for rank, (ss, ws) in enumerate(parts)
    ]


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _check_resume(trainer: Trainer, rank: int, world_size: int, folder: Path) -> None:
    """Save `trainer`, load into a fresh one: every local shard of the adapters and of
    their optimizer state equal (asserted on every rank)."""
    from drmas.checkpoints import store
    from drmas.learners import checkpoint as ckpt
    from drmas.learners.trainer import Trainer

    ckpt.save(trainer, folder, 1, keep=1)
    fresh = Trainer(trainer.cfg, MODEL, rank, world_size, "cpu")
    found = store.find(folder, 1)
    assert found is not None
    ckpt.load(fresh, found)
    for p, q in zip(trainer.model.parameters(), fresh.model.parameters()):
        assert torch.equal(_local(p.detach()), _local(q.detach()))
        if p.requires_grad:
            for key, value in trainer.optimizer.state[p].items():
                assert torch.equal(_local(fresh.optimizer.state[q][key]), _local(value)), key


def lora_worker(rank: int, world_size: int, init: str, cfg, runs: dict, out: str) -> None:
    """Per named list of shards: a fresh Trainer's adapters before and after one step.
    After the last: the export and a checkpoint round trip."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from drmas.learners.trainer import Trainer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    try:
        results = {}
        for name, shard_list in runs.items():
            trainer = Trainer(cfg, MODEL, rank, world_size, "cpu")
            before = dict(trainer.full_state_dict_iter())
            metrics = trainer.step(shard_list[rank])
            after = dict(trainer.full_state_dict_iter())
            results[name] = {"before": before, "after": after, "metrics": metrics}
        trainer.save_pretrained(Path(out).with_suffix(".hf"))
        _check_resume(trainer, rank, world_size, Path(out).with_suffix(".ckpt"))
        if rank == 0:
            torch.save(results, out)
        dist.barrier()  # tear the group down together (test_fsdp_learner.grad_worker)
    finally:
        dist.destroy_process_group()
    leave()  # only once it went through: an exception goes back to mp.spawn


def run_world(world_size: int, cfg, out: Path) -> dict:
    runs = {"mixed": shards(make_samples(), world_size), "verifier": verifier_only(world_size)}
    mp.spawn(
        lora_worker,
        args=(world_size, gloo_init(), cfg, runs, str(out)),
        nprocs=world_size,
        join=True,
    )
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora")
    model_dir = tiny_qwen2(tmp / "model")
    cfg = lora_config(model_dir)
    return {
        "model_dir": model_dir,
        "one": run_world(1, cfg, tmp / "one.pt"),
        "two": run_world(2, cfg, tmp / "two.pt"),
        "two_saved": tmp / "two.hf",
    }


def test_two_ranks_train_the_adapters_like_one(worlds: dict) -> None:
    one, two = worlds["one"]["mixed"], worlds["two"]["mixed"]
    assert list(one["before"]) == sorted(one["before"])  # the wire order: sorted names
    for name, start in one["before"].items():
        assert torch.equal(start, two["before"][name]), name
        assert not torch.equal(one["after"][name], start) or ".lora_A." in name, name
    # Tolerance as in test_fsdp_learner: the same float32 math summed in another order
    # (per rank, then reduce-scatter), and AdamW's first step is ≈ lr·sign(g).
    for name, expected in one["after"].items():
        torch.testing.assert_close(two["after"][name], expected, atol=1e-6, rtol=1e-5, msg=name)
    grad_norm = f"grad_norm/{MODEL}"
    assert two["metrics"][grad_norm] == pytest.approx(one["metrics"][grad_norm], rel=1e-5)


@pytest.mark.parametrize("world", ["one", "two"])
def test_an_adapter_without_steps_stays_bit_identical(worlds: dict, world: str) -> None:
    run = worlds[world]["verifier"]
    for name, start in run["before"].items():
        if ".solver." in name:
            assert torch.equal(run["after"][name], start), name
        elif ".lora_B." in name:
            assert not torch.equal(run["after"][name], start), name


def test_two_rank_export_is_the_base_and_the_trained_adapters(worlds: dict) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    saved_dir = worlds["two_saved"]
    source = dict(AutoModelForCausalLM.from_pretrained(worlds["model_dir"]).named_parameters())
    base = AutoModelForCausalLM.from_pretrained(saved_dir)
    for name, tensor in base.named_parameters():
        assert torch.equal(tensor, source[name]), name
    trained = worlds["two"]["verifier"]["after"]
    for adapter in ("solver", "verifier"):
        loaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(saved_dir),
            str(saved_dir / "adapters" / adapter),
            adapter_name=adapter,
        )
        params = dict(loaded.named_parameters())
        mine = {n: t for n, t in trained.items() if f".{adapter}." in n}
        assert mine and all(torch.equal(params[n], t) for n, t in mine.items()), adapter


class PlanningBroker(FakeBroker):
    """FakeBroker whose plans name the adapters to send: the verifier's only."""

    def answer(self, msg: object):  # -> reply or None
        reply = super().answer(msg)
        if isinstance(reply, WeightGroupPlan):
            return msgspec.structs.replace(reply, adapters=["verifier"])
        return reply


def test_learner_process_publishes_only_the_planned_adapters(tmp_path: Path) -> None:
    from drmas.transports.digest import digest_of
    from drmas.transports.weights import WeightReceiver

    cfg = lora_config(tiny_qwen2(tmp_path / "model"))
    broker = PlanningBroker(shards(make_samples(), 2), steps=2)
    broker.start()
    cfg.broker.address = broker.address
    cfg.run.dir = str(tmp_path / "run")
    cfg.train.steps = 3
    received: dict[int, list[tuple[str, torch.Tensor]]] = {}

    def actor() -> None:
        receiver = WeightReceiver()
        while (join := broker.joins.get()) is not None:
            state = received.setdefault(join.version, [])
            receiver.receive_into(join, lambda b, s=state: s.extend((n, t.clone()) for n, t in b))
        receiver.release()

    actor_thread = threading.Thread(target=actor, daemon=True)
    actor_thread.start()
    try:
        mp.spawn(learner_worker, args=(free_port(), cfg), nprocs=2, join=True)
    finally:
        broker.joins.put(None)
        actor_thread.join(30)
        broker.stop.set()
        broker.join(10)

    # every batch holds both agents: each adapter's version is the model's, on both ranks
    for msg in broker.received:
        if isinstance(msg, (BatchRequest, PublishRequest)):
            assert msg.adapter_versions == {"solver": msg.version, "verifier": msg.version}
    asked = {(m.rank, m.version) for m in broker.received if isinstance(m, BatchRequest)}
    assert asked == {(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)}  # at 2 rank 0 hears "done"
    reports = [m for m in broker.received if isinstance(m, StepReport)]
    assert [(r.version, r.metrics["adapter_version/solver"]) for r in reports] == [
        (1, 1.0),
        (2, 2.0),
    ]

    done = [m for m in broker.received if isinstance(m, PublishDone)]
    assert [(d.version, d.ok) for d in done] == [(1, False), (2, True)]
    names = [n for n, _ in received[2]]
    assert names == sorted(names) and len(names) == 2 * 2 * 4  # layers, A/B, q k v o
    assert all(".lora_" in n and ".verifier." in n for n in names)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run" / "models" / MODEL
    loaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(out),
        str(out / "adapters" / "solver"),
        adapter_name="solver",
    )
    loaded.load_adapter(str(out / "adapters" / "verifier"), adapter_name="verifier")
    exported = {n: p.detach() for n, p in loaded.named_parameters() if ".lora_" in n}
    assert len(exported) == 2 * len(names)
    for name, tensor in received[2]:
        assert torch.equal(exported[name], tensor), name  # the actor holds the export
    # the digest covers the adapter that was not sent too (fp32: the publish dtype)
    assert done[1].digest == digest_of(exported.items()) != digest_of(received[2])
