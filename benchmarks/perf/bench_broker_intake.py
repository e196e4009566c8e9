"""Broker intake of 256-token steps vs a raw pyzmq PUSH/PULL of the same bytes.

    python benchmarks/perf/bench_broker_intake.py [--groups 2000] [--out benchmarks/results/broker_intake.json]

drmas: a real broker process (BrokerServer on loopback); one client process says Hello,
takes leases, then streams GroupResults (G episodes x 2 steps, 256 response tokens each)
without waiting, and counts Accepted replies. Every group is decoded, validated, checked
against its lease, split per model and buffered, and answered. Baseline: the same encoded
frames through a raw PUSH/PULL pair, alternating rep by rep. Target ratio (drmas steps/s /
raw steps/s) >= 0.8; the median ratio is reported with each rep's own ratio (the spread).
The broker's CPU per message type in a whole run is in bench_broker_scale.py.

Advantages and training samples are made when a learner's batch is cut, not at intake;
`cut_us_per_group` reports that cost separately (in-process, B=100 groups per batch).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

VOCAB = 32_000
RESPONSE = 256
SPAWN = mp.get_context("spawn")
PROMPT = 128


def make_frames(groups: int, group_size: int, leases: list[tuple[int, int]]) -> list[bytes]:
    from drmas.protocol import encode, pack_ids, pack_logprobs
    from drmas.protocol.messages import Episode, Step, pack_group

    rng = np.random.default_rng(0)
    frames = []
    for g in range(groups):
        lease_id, group_id = leases[g]
        episodes = []
        for e in range(group_size):
            steps = [
                Step(
                    agent=agent,
                    model=agent,
                    prompt_ids=pack_ids(rng.integers(0, VOCAB, PROMPT)),
                    response_ids=pack_ids(rng.integers(0, VOCAB, RESPONSE)),
                    logprobs=pack_logprobs(-rng.random(RESPONSE)),
                    version=0,
                    valid=True,
                    finish_reason="stop",
                )
                for agent in ("solver", "verifier")
            ]
            episodes.append(Episode(steps, float(e % 2)))
        frames.append(encode(pack_group("bench", lease_id, group_id, episodes)))
    return frames


def broker_main(cfg_path: str, ready: mp.Queue) -> None:
    from drmas.broker.server import BrokerServer
    from drmas.config import load_config

    cfg = load_config([], cfg_path)
    server = BrokerServer(cfg, None)
    ready.put(server.address)
    if os.environ.get("DRMAS_PROFILE_BROKER"):  # python -m cProfile-style dump on SIGTERM
        import cProfile
        import signal

        profile = cProfile.Profile()

        def dump(*_: object) -> None:
            profile.disable()
            profile.dump_stats(os.environ["DRMAS_PROFILE_BROKER"])
            os._exit(0)

        signal.signal(signal.SIGTERM, dump)
        profile.enable()
    server.serve(max_seconds=600)


def run_drmas(groups: int, group_size: int, workdir: Path) -> float:
    from drmas.config import load_config, to_yaml
    from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode
    from drmas.protocol.messages import Accepted, Hello, LeaseRequest

    model = workdir / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    cfg = load_config(
        [
            f"models.solver.path={model}",
            f"models.verifier.path={model}",
            f"group_size={group_size}",
            f"batch_groups={groups}",
            "train.steps=1",
            "val.every=0",
            f"sampling.max_new_tokens={RESPONSE}",
        ]
    )
    cfg_path = workdir / "config.yaml"
    cfg_path.write_text(to_yaml(cfg))
    ready: mp.Queue = SPAWN.Queue()
    proc = SPAWN.Process(target=broker_main, args=(str(cfg_path), ready))
    proc.start()
    address = ready.get(timeout=60)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"bench")
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    sock.send(encode(Hello("actor", "bench", PROTOCOL_VERSION, ["solver", "verifier"])))
    decode_from_broker(sock.recv())
    leases: list[tuple[int, int]] = []
    while len(leases) < groups:
        sock.send(encode(LeaseRequest("bench", min(1024, groups - len(leases)), {})))
        reply = decode_from_broker(sock.recv())
        leases += [(x.lease_id, x.group_id) for x in reply.leases]  # type: ignore[union-attr]
    frames = make_frames(groups, group_size, leases)
    start = time.perf_counter()
    accepted = 0
    for frame in frames:
        sock.send(frame)
    for _ in frames:
        reply = decode_from_broker(sock.recv())
        accepted += isinstance(reply, Accepted) and reply.accepted
    seconds = time.perf_counter() - start
    assert accepted == groups, f"only {accepted}/{groups} accepted"
    sock.close(0)
    ctx.term()
    proc.terminate()
    proc.join(10)
    return seconds


def pull_main(address: str, count: int, done: mp.Queue) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    done.put("ready")
    for _ in range(count):
        sock.recv()
    done.put("done")
    sock.close(0)
    ctx.term()


def run_raw(frames: list[bytes]) -> float:
    from drmas.transports.ports import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    done: mp.Queue = SPAWN.Queue()
    proc = SPAWN.Process(target=pull_main, args=(address, len(frames), done))
    proc.start()
    done.get(timeout=60)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    start = time.perf_counter()
    for frame in frames:
        sock.send(frame)
    done.get(timeout=600)
    seconds = time.perf_counter() - start
    sock.close(0)
    ctx.term()
    proc.join(10)
    return seconds


def cut_cost(frames: list[bytes], batch_groups: int = 100) -> float:
    """Microseconds per group to turn buffered groups into advantages, samples and shards."""
    from drmas.broker.buffers import batch_samples, shard, split_group
    from drmas.config.broker import AdvantageConfig
    from drmas.protocol import decode_to_broker
    from drmas.protocol.messages import GroupResult

    by_model: dict[str, list] = {}
    for i, frame in enumerate(frames):
        group = decode_to_broker(memoryview(frame))
        assert isinstance(group, GroupResult)
        agents = {"solver": "solver", "verifier": "verifier"}
        for model, part in split_group(i, None, group, agents, 0.01).items():  # type: ignore[arg-type]
            by_model.setdefault(model, []).append(part)
    start = time.perf_counter()
    for model, parts in by_model.items():
        for b in range(0, len(parts) - batch_groups + 1, batch_groups):
            samples = batch_samples(parts[b : b + batch_groups], AdvantageConfig())
            shard(model, 0, samples, 2)
    return (time.perf_counter() - start) / len(frames) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=1000)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default="benchmarks/results/broker_intake.json")
    args = parser.parse_args()
    steps = args.groups * args.group_size * 2
    frames = make_frames(args.groups, args.group_size, [(0, 0)] * args.groups)
    raw, ours = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.reps):
            raw.append(run_raw(frames))
            ours.append(run_drmas(args.groups, args.group_size, Path(tmp)))
    raw_s, ours_s = statistics.median(raw), statistics.median(ours)
    result = {
        "groups": args.groups,
        "steps": steps,
        "response_tokens_per_step": RESPONSE,
        "frame_bytes": len(frames[0]),
        "raw_push_pull_steps_per_s": steps / raw_s,
        "broker_steps_per_s": steps / ours_s,
        "ratio": raw_s / ours_s,
        "ratio_per_rep": [r / o for r, o in zip(raw, ours)],
        "ratio_min": min(r / o for r, o in zip(raw, ours)),
        "ratio_max": max(r / o for r, o in zip(raw, ours)),
        "cut_us_per_group": cut_cost(frames),
        "raw_s": raw,
        "broker_s": ours,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, list)}, indent=2))


if __name__ == "__main__":
    main()
