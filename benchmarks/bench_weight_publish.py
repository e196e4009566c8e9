"""Bucketed weight publish vs one flat broadcast of the same bytes (gloo, loopback).

The learner (this process) publishes a ~50 MB float32 model with Qwen2-like parameter
shapes to one receiver process, `--reps` times after a warm-up. Each bucketed publish is
the real thing: a fresh weight group (rendezvous), the header, then 8 MiB buckets. The
baseline broadcasts one flat tensor of the same bytes over a group built once beforehand,
the floor of what the wire allows (ratio = bucketed / flat, target <= 1.5). A third
timing broadcasts the flat tensor over a group built for it, rendezvous included: the
floor for any design that forms a new group per publish. Rounds interleave the three, so
all see the same background load; each timing starts once the receiver says it is
waiting and ends with its 1-int acknowledgement, so "sent" means "received". Tearing a
group down (~20 ms in gloo, GIL held) happens after PublishDone on both sides, off the
sync's path; it is reported separately as teardown_s.

    .venv/bin/python benchmarks/bench_weight_publish.py [--out PATH] [--reps 5]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.config import WeightSyncConfig
from drmas.transports.weights import WeightReceiver, WeightSender, spec_of

TIMEOUT = datetime.timedelta(seconds=120)


def qwen2_like(hidden: int = 384, layers: int = 3, inter: int = 1536, vocab: int = 8192):
    """Parameter names and shapes of a small Qwen2 (GQA 4:1); ≈12.7 M params ≈ 51 MB fp32."""
    kv = hidden // 4
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.q_proj.bias", (hidden,)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    gen = torch.Generator().manual_seed(0)
    return [(name, torch.randn(shape, generator=gen)) for name, shape in shapes]


def control_group(store: dist.Store, rank: int) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(dist.PrefixStore("bench-control", store), rank, 2, TIMEOUT)


def fresh_group(store: dist.Store, rank: int, i: int) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(dist.PrefixStore(f"bench-fresh-{i}", store), rank, 2, TIMEOUT)


def bcast(pg: dist.ProcessGroupGloo, tensor: torch.Tensor, root: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]


def receiver(address: str, nbytes: int, rounds: int) -> None:
    torch.set_num_threads(1)
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)
    ctl = control_group(store, 1)
    ack = torch.ones(1, dtype=torch.int64)
    flat = torch.empty(nbytes // 4)
    recv = WeightReceiver(WeightSyncConfig())
    for i in range(rounds):  # one bucketed publish, then one flat broadcast, per round
        join = JoinWeightGroup("bench", i, f"bench-{i}", address, 1, 2, TIMEOUT.total_seconds())
        bcast(ctl, ack, root=1)  # ready
        recv.receive_into(join, lambda batch: None)
        bcast(ctl, ack, root=1)  # received
        recv.release()  # as an actor does once generation has resumed
        bcast(ctl, ack, root=1)
        bcast(ctl, flat, root=0)
        bcast(ctl, ack, root=1)
        bcast(ctl, ack, root=1)
        fresh = fresh_group(store, 1, i)
        bcast(fresh, flat, root=0)
        bcast(ctl, ack, root=1)
        fresh.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/weight_publish.json")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions after warm-up")
    parser.add_argument("--bucket-mb", type=float, default=WeightSyncConfig.bucket_mb)
    args = parser.parse_args()
    torch.set_num_threads(1)

    state = qwen2_like()
    specs = [spec_of(n, t) for n, t in state]
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    rounds = args.reps + 1
    sender = WeightSender(WeightSyncConfig(bucket_mb=args.bucket_mb, timeout_s=120.0))
    proc = multiprocessing.get_context("spawn").Process(
        target=receiver, args=(sender.store_address, nbytes, rounds), daemon=True
    )
    proc.start()
    try:
        ctl = control_group(sender.store, 0)
        ack = torch.zeros(1, dtype=torch.int64)
        flat_tensor = torch.cat([t.reshape(-1) for _, t in state])
        bucketed, flat, fresh_flat, teardown, buckets = [], [], [], [], 0
        for i in range(rounds):  # interleaved, so both see the same background load
            bcast(ctl, ack, root=1)  # the receiver is waiting for the group
            start = time.perf_counter()
            stats = sender.publish(f"bench-{i}", 2, iter(state), 120.0, specs=specs)
            bcast(ctl, ack, root=1)
            bucketed.append(time.perf_counter() - start)
            buckets = stats.buckets
            start = time.perf_counter()
            sender.release()  # as the learner does after PublishDone
            teardown.append(time.perf_counter() - start)

            bcast(ctl, ack, root=1)
            start = time.perf_counter()
            bcast(ctl, flat_tensor, root=0)
            bcast(ctl, ack, root=1)
            flat.append(time.perf_counter() - start)

            bcast(ctl, ack, root=1)
            start = time.perf_counter()
            fresh = fresh_group(sender.store, 0, i)
            bcast(fresh, flat_tensor, root=0)
            bcast(ctl, ack, root=1)
            fresh_flat.append(time.perf_counter() - start)
            fresh.shutdown()
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()

    result = {
        "bucketed_s": statistics.median(bucketed[1:]),
        "flat_s": statistics.median(flat[1:]),
        "fresh_group_flat_s": statistics.median(fresh_flat[1:]),
        "bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        "buckets": buckets,
        "reps": args.reps,
        "teardown_s": statistics.median(teardown[1:]),
        "bucketed_all_s": bucketed[1:],
        "flat_all_s": flat[1:],
    }
    result["ratio"] = result["bucketed_s"] / result["flat_s"]
    result["ratio_vs_fresh_group_flat"] = result["bucketed_s"] / result["fresh_group_flat_s"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{nbytes / 1e6:.1f} MB: bucketed {result['bucketed_s'] * 1e3:.1f} ms "
        f"({buckets} buckets of {args.bucket_mb} MiB, incl. group + header), "
        f"flat {result['flat_s'] * 1e3:.1f} ms, ratio {result['ratio']:.2f} (target <= 1.5); "
        f"flat on a fresh group {result['fresh_group_flat_s'] * 1e3:.1f} ms, "
        f"ratio {result['ratio_vs_fresh_group_flat']:.2f}"
    )


if __name__ == "__main__":
    main()
