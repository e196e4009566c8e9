"""A whole-model publish and load of SmolLM2-135M (538 MB fp32): learner rank 0's stream to
one actor's hf engine over gloo on loopback, as a run does it, in three ways per round.

This process is learner rank 0 (WeightSender, the weights streamed through `hashing` as
drmas/learners/main.py does, with the broker's token: roll call and proof included); a
spawned process is the actor (the real HFEngine on the same folder, WeightReceiver with
the engine's expectation, backup before the load as Actor.sync_weights does). Per round,
in rotating order:

- read_back: the actor's path for an engine that reads back (hf, whole model): each
  bucket hashed as the engine holds it once loaded, that fingerprint reported;
- bucket_hash: the path of an engine without read-back (or a dtype that differs from the
  learner's): each bucket hashed as received, then the engine's fingerprint of the whole
  model after the load (the path every hf load took before read-back);
- no_digest: weights.verify_digest=false on both sides: the wire, the copies and the
  finiteness check only (the floor the two above are measured against).

publish_s: the sender's `publish` call; load_s: the actor's backup + receive + fingerprint
(its pause is not included: it depends on the decode step in flight). CPU-seconds of each
process over the same span beside them. Goals (issue #46): publish <= 1 s, load <= 1 s
with the digest on, on a quiet machine (the CPUs' busy share over 5 s before the first
round is recorded; above 10 % the result says it was not quiet).

    .venv/bin/python benchmarks/perf/bench_publish_load.py [--rounds 5] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

from benchmarks.provenance import git_state  # noqa: E402

MODES = ("read_back", "bucket_hash", "no_digest")


def actor(conn: Any, folder: str, addresses: dict[str, str], rounds: int, threads: int) -> None:
    """The actor side: load every round's publish into a real hf engine, report timings."""
    from drmas.actors.engines.hf import HFEngine
    from drmas.config.actor import EngineConfig
    from drmas.config.transport import WeightSyncConfig
    from drmas.protocol.messages import JoinWeightGroup
    from drmas.transports.weights import WeightReceiver

    torch.set_num_threads(threads)
    engine = HFEngine("m", folder, EngineConfig())
    engine._load()  # the model only: no scheduler, nothing generates during the benchmark
    receivers = {
        verify: WeightReceiver(
            WeightSyncConfig(verify_digest=verify), expected=lambda j: engine.expected_weights([])
        )
        for verify in (True, False)
    }
    for version in range(1, rounds * len(MODES) + 1):
        mode = conn.recv()
        receiver = receivers[mode != "no_digest"]
        # a model name and a store per mode: each mode's group is kept across its rounds, as
        # a run keeps its group while the members stay the same
        join = JoinWeightGroup(
            f"m-{mode}", version, f"g-{mode}", addresses[mode], 1, 2, 120.0, "tok"
        )
        conn.send("ready")
        wall, cpu = time.perf_counter(), time.process_time()
        engine.backup_weights()
        live = engine.loaded_view() if mode == "read_back" else None
        got = receiver.receive_into(
            join, lambda batch, v=version: engine.load_weights(batch, v), None, live
        )
        digest = "" if mode == "no_digest" else got.digest or engine.weights_digest()
        conn.send(
            {
                "load_s": time.perf_counter() - wall,
                "load_cpu_s": time.process_time() - cpu,
                "digest": digest,
                "read_back": bool(got.digest),
            }
        )
    for receiver in receivers.values():
        receiver.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/publish_load.json")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after a warm-up")
    parser.add_argument("--model", default="builtin:smollm2-135m")
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, len(os.sched_getaffinity(0)) // 2),
        help="torch threads of each side (default: what drmas train hands a learner and an "
        "actor sharing this machine's CPUs)",
    )
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from drmas.config.model import WarmStartConfig
    from drmas.config.transport import WeightSyncConfig
    from drmas.models.builtin import resolve_model_path
    from drmas.transports.digest import Digest, hashing
    from drmas.transports.weights import WeightSender, spec_of

    folder = str(resolve_model_path(args.model, None, WarmStartConfig(steps=0)))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = [(n, p.detach()) for n, p in model.named_parameters()]
    specs = [spec_of(n, t) for n, t in state]
    torch.set_num_threads(args.threads)
    senders = {
        mode: WeightSender(WeightSyncConfig(verify_digest=mode != "no_digest", timeout_s=120.0))
        for mode in MODES
    }
    addresses = {mode: sender.store_address for mode, sender in senders.items()}
    busy_at_start = psutil.cpu_percent(interval=5.0)
    load_at_start = os.getloadavg()[0]
    rounds = args.rounds + 1
    here, there = multiprocessing.get_context("spawn").Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=actor, args=(there, folder, addresses, rounds, args.threads), daemon=True
    )
    proc.start()
    rows: list[dict[str, Any]] = []
    version = 0
    try:
        for r in range(rounds):
            for mode in MODES[r % 3 :] + MODES[: r % 3]:
                version += 1
                here.send(mode)
                assert here.poll(300) and here.recv() == "ready"
                digest = Digest()
                verify = mode != "no_digest"
                stream = hashing(iter(state), digest) if verify else iter(state)
                wall, cpu = time.perf_counter(), time.process_time()
                stats = senders[mode].publish(
                    f"g-{mode}", 2, stream, 120.0, specs=specs, token="tok",
                    digest=digest if verify else None, version=version,
                )  # fmt: skip
                row = {"round": r, "mode": mode, "publish_s": time.perf_counter() - wall,
                       "publish_cpu_s": time.process_time() - cpu, "bytes": stats.bytes}  # fmt: skip
                assert here.poll(300)
                got = here.recv()
                learner_digest = digest.hexdigest() if verify else ""
                assert got.pop("digest") == learner_digest, f"{mode}: digests differ"
                rows.append({**row, **got})
                print(json.dumps(rows[-1]), flush=True)
        proc.join(60)
    finally:
        for sender in senders.values():
            sender.close()
        if proc.is_alive():
            proc.kill()

    timed = [row for row in rows if row["round"] > 0]
    keys = ("publish_s", "publish_cpu_s", "load_s", "load_cpu_s")
    median = {
        mode: {k: statistics.median(row[k] for row in timed if row["mode"] == mode) for k in keys}
        for mode in MODES
    }
    result = {
        "median": median,
        "ratio_read_back_vs_bucket_hash": {
            k: median["read_back"][k] / median["bucket_hash"][k] for k in ("publish_s", "load_s")
        },
        "goals": {
            "publish_s <= 1": median["read_back"]["publish_s"] <= 1.0,
            "load_s <= 1": median["read_back"]["load_s"] <= 1.0,
        },
        "quiet": busy_at_start <= 10.0,
        "cpu_busy_pct_at_start": busy_at_start,
        "load_at_start": load_at_start,
        "load_at_end": os.getloadavg()[0],
        "cpus": len(os.sched_getaffinity(0)),
        "threads_per_side": args.threads,
        "model": args.model,
        "bytes": rows[0]["bytes"],
        "rounds": args.rounds,
        "runs": rows,
        "git": git_state(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for mode in MODES:
        m = median[mode]
        print(f"{mode:12s} publish {m['publish_s']:.2f} s ({m['publish_cpu_s']:.2f} CPU-s), "
              f"load {m['load_s']:.2f} s ({m['load_cpu_s']:.2f} CPU-s)")  # fmt: skip
    quiet = "" if result["quiet"] else f" (NOT quiet: CPUs {busy_at_start:.0f} % busy at start)"
    print(f"-> {out}{quiet}")


if __name__ == "__main__":
    main()
