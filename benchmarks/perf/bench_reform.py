"""Seconds to re-form a model's weight group and deliver the weights, for 1, 4 and 8 actors.

    python benchmarks/perf/bench_reform.py [--sizes 1 4 8] [--reps 5] [--mb 4] [--out benchmarks/results/reform.json]

What is measured, exactly: this process plays learner rank 0 (a WeightSender hosting the
run's TCPStore); N actor processes (already started, torch imported, each with a
WeightReceiver and a `sim` engine) wait for a JoinWeightGroup on a pipe, as the actor
process gets it from the broker. One sample is the wall time from handing the N joins
out (the moment the broker answers a PublishRequest) until the last of the N actors
reports back, i.e. the equivalent of its WeightsLoaded:

    new gloo group over PrefixStore(group name) (the re-formation: rendezvous of N + 1 ranks)
    + header + every bucket broadcast (--mb MiB of float32 tensors, 8 MiB buckets)
    + SimEngine.load_weights on every actor (consumes the tensors into the digest)
    + weights_digest() and the reply over the pipe.

This benchmark forms a fresh group for every publish: what a run pays when membership
changes (an actor attaching between versions re-forms its model's group with the larger
membership; a kept group costs less, see bench_weight_publish.py; drmas/transports/weights/).
The first publish of each size is a warm-up and not counted. Not included: the broker's
message hops (sub-millisecond on loopback) and gathering FSDP shards on the learner.
Median and min over --reps publishes. All processes share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from drmas.actors.engines.sim import SimEngine
from drmas.config.actor import EngineConfig
from drmas.config.transport import WeightSyncConfig
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.digest import digest_of
from drmas.transports.weights import WeightReceiver, WeightSender

TIMEOUT_S = 60.0


def actor(conn: Connection) -> None:
    """One actor: receive every join it is sent into a sim engine, answer with its digest."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(WeightSyncConfig(timeout_s=TIMEOUT_S))
    engine = SimEngine("policy", "", EngineConfig(name="sim"))
    conn.send("ready")
    while (join := conn.recv()) is not None:
        receiver.receive_into(join, lambda ts, v=join.version: engine.load_weights(ts, v))
        conn.send(engine.weights_digest())
        receiver.release()


def weights(mb: float) -> list[tuple[str, torch.Tensor]]:
    """--mb MiB of float32 in 32 tensors (the builtin tiny model is ~4 MiB)."""
    per = int(mb * 2**20 / 4 / 32)
    g = torch.Generator().manual_seed(0)
    return [(f"layer.{i}.weight", torch.randn(per, generator=g)) for i in range(32)]


def measure(size: int, reps: int, tensors: list[tuple[str, torch.Tensor]]) -> list[float]:
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(size)]
    procs = [ctx.Process(target=actor, args=(child,), daemon=True) for _, child in pipes]
    for p in procs:
        p.start()
    sender = WeightSender(WeightSyncConfig(timeout_s=TIMEOUT_S))
    expected = digest_of(tensors)
    samples: list[float] = []
    try:
        for conn, _ in pipes:
            if not conn.poll(120) or conn.recv() != "ready":
                raise TimeoutError("an actor process did not start")
        for rep in range(reps + 1):  # rep 0: warm-up
            name = f"policy/v{rep}/{size}"
            start = time.perf_counter()
            for rank, (conn, _) in enumerate(pipes, start=1):
                conn.send(
                    JoinWeightGroup(
                        "policy", rep, name, sender.store_address, rank, size + 1, TIMEOUT_S
                    )
                )
            sender.publish(name, size + 1, tensors, TIMEOUT_S)
            for conn, _ in pipes:
                if not conn.poll(TIMEOUT_S):
                    raise TimeoutError(f"an actor did not load {name}")
                if conn.recv() != expected:
                    raise RuntimeError(f"{name}: an actor's digest does not match the sender's")
            seconds = time.perf_counter() - start
            sender.release()
            if rep:
                samples.append(seconds)
    finally:
        for conn, _ in pipes:
            conn.send(None)
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--out", default="benchmarks/results/reform.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tensors = weights(args.mb)
    result: dict = {
        "what": "publish request -> every actor loaded and answered (new gloo group each time)",
        "weights_mb": args.mb,
        "reps": args.reps,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "actors": {},
    }
    for size in args.sizes:
        samples = measure(size, args.reps, tensors)
        result["actors"][str(size)] = {
            "median_s": statistics.median(samples),
            "min_s": min(samples),
            "samples_s": samples,
        }
        print(f"{size} actors: median {statistics.median(samples):.3f}s min {min(samples):.3f}s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
