"""Weight publish over a kept group vs one flat broadcast of the same bytes (gloo, loopback).

The learner (this process) publishes a ~50 MB float32 model with Qwen2-like parameter
shapes to one receiver process, `--reps` times after a warm-up, in interleaved rounds (so
every timing sees the same background load). Per round:

- kept: the real publish of the next version to unchanged members: the group of the
  previous round is reused (no rendezvous, no teardown), then the header and 8 MiB buckets;
- new group: the real publish to a group under a new name, as after a membership change:
  the old group is aborted, a new one forms (rendezvous), header and buckets; its later
  teardown is timed too (teardown_s) and counted in new_group_total_s;
- flat: one flat tensor of the same bytes over a group built once beforehand (the floor
  of what the wire allows);
- fresh flat: that flat tensor over a group built for it and torn down after, set-up and
  teardown included: what one broadcast costs when every publish forms its own group.

Each timing starts once the receiver says it is waiting and ends with its 1-int
acknowledgement, so "sent" means "received". Goal (issue #15): kept <= 1.2x flat.

    .venv/bin/python benchmarks/perf/bench_weight_publish.py [--out PATH] [--reps 9]
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

from drmas.config.transport import WeightSyncConfig
from drmas.protocol.messages import JoinWeightGroup
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
    seconds = TIMEOUT.total_seconds()
    for i in range(rounds):
        for model, name in (("kept", "bench-kept"), ("new", f"bench-new-{i}")):
            join = JoinWeightGroup(model, i, name, address, 1, 2, seconds)
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
    recv.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/weight_publish.json")
    parser.add_argument("--reps", type=int, default=9, help="timed repetitions after warm-up")
    parser.add_argument("--bucket-mb", type=float, default=WeightSyncConfig.bucket_mb)
    args = parser.parse_args()
    torch.set_num_threads(1)

    state = qwen2_like()
    specs = [spec_of(n, t) for n, t in state]
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    rounds = args.reps + 1
    cfg = WeightSyncConfig(bucket_mb=args.bucket_mb, timeout_s=120.0)
    kept_sender, new_sender = WeightSender(cfg), WeightSender(cfg)
    assert kept_sender.store_address != new_sender.store_address
    proc = multiprocessing.get_context("spawn").Process(
        target=receiver, args=(kept_sender.store_address, nbytes, rounds), daemon=True
    )
    # the receiver joins both senders' groups through one store address: give the second
    # sender's groups the first one's store (the kept/new distinction is the group name)
    new_sender.store = kept_sender.store
    proc.start()
    t: dict[str, list[float]] = {k: [] for k in ("kept", "new", "teardown", "flat", "fresh")}
    reused: list[bool] = []
    buckets = 0
    try:
        ctl = control_group(kept_sender.store, 0)
        ack = torch.zeros(1, dtype=torch.int64)
        flat_tensor = torch.cat([x.reshape(-1) for _, x in state])
        for i in range(rounds):
            for key, sender, name in (("kept", kept_sender, "bench-kept"),
                                      ("new", new_sender, f"bench-new-{i}")):  # fmt: skip
                bcast(ctl, ack, root=1)  # the receiver is waiting
                start = time.perf_counter()
                stats = sender.publish(name, 2, iter(state), 120.0, specs=specs)
                bcast(ctl, ack, root=1)
                t[key].append(time.perf_counter() - start)
                buckets = stats.buckets
                if key == "kept":
                    reused.append(stats.reused)
                else:  # the next round's new name retires this group: time that teardown
                    start = time.perf_counter()
                    live = new_sender._live
                    new_sender.close()
                    t["teardown"].append(time.perf_counter() - start if live else 0.0)

            bcast(ctl, ack, root=1)
            start = time.perf_counter()
            bcast(ctl, flat_tensor, root=0)
            bcast(ctl, ack, root=1)
            t["flat"].append(time.perf_counter() - start)

            bcast(ctl, ack, root=1)
            start = time.perf_counter()
            fresh = fresh_group(kept_sender.store, 0, i)
            bcast(fresh, flat_tensor, root=0)
            bcast(ctl, ack, root=1)
            fresh.shutdown()
            t["fresh"].append(time.perf_counter() - start)
        proc.join(60)
    finally:
        kept_sender.close()
        if proc.is_alive():
            proc.kill()

    med = {k: statistics.median(v[1:]) for k, v in t.items()}
    new_total = [a + b for a, b in zip(t["new"][1:], t["teardown"][1:])]
    result = {
        "kept_s": med["kept"],
        "new_group_s": med["new"],
        "teardown_s": med["teardown"],
        "new_group_total_s": statistics.median(new_total),
        "flat_s": med["flat"],
        "fresh_flat_total_s": med["fresh"],
        "ratio_kept_vs_flat": med["kept"] / med["flat"],
        "ratio_kept_vs_fresh_flat": med["kept"] / med["fresh"],
        "ratio_new_group_total_vs_flat": statistics.median(new_total) / med["flat"],
        "goal": "kept <= 1.2 x flat",
        "kept_reused": reused[1:],
        "bytes": nbytes,
        "bucket_mb": args.bucket_mb,
        "buckets": buckets,
        "reps": args.reps,
        "all_s": {k: v[1:] for k, v in t.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{nbytes / 1e6:.1f} MB in {buckets} buckets of {args.bucket_mb} MiB: kept group "
        f"{med['kept'] * 1e3:.1f} ms, flat {med['flat'] * 1e3:.1f} ms -> "
        f"{result['ratio_kept_vs_flat']:.2f}x (goal <= 1.2); flat on a fresh group with "
        f"set-up and teardown {med['fresh'] * 1e3:.1f} ms -> "
        f"{result['ratio_kept_vs_fresh_flat']:.2f}x; new group incl. teardown "
        f"{result['new_group_total_s'] * 1e3:.1f} ms -> "
        f"{result['ratio_new_group_total_vs_flat']:.2f}x"
    )


if __name__ == "__main__":
    main()
