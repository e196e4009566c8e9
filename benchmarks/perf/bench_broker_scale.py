"""How much one broker can feed: its CPU per message and steps/s, 1 -> 256 actors, 2 -> 8 agents.

    python benchmarks/perf/bench_broker_scale.py [--actors 1 4 16 64 256] [--agents 2 4 8]
        [--out benchmarks/results/broker_scale.json]

A real broker process (BrokerServer on loopback) runs a run's whole protocol against
simulated clients in one load-generator process:
- actors (DEALER sockets) say Hello, heartbeat every broker.heartbeat_interval_s, take
  leases (2 groups per request, as `actor.max_groups` would) and answer each with a full
  GroupResult at once: G = 8 episodes, one step per agent, 128 prompt and 256 response
  tokens per step, every buffer validated by the broker as in a real run;
- one learner per model asks for its batch, reports the step and asks for the next, so
  the broker cuts batches (advantages over whole groups, shards) as in a real run.
Generation and training cost nothing, so the broker (and the load generator sharing its
2 cores) is the bottleneck. Weight publishing is left out: it is a few messages per
step, not per group (algorithm.max_staleness is set high so actors need no new weights).

Measured per run: the broker's thread CPU per message type (drmas/broker/cpu.py), its CPU
per accepted group (all messages and housekeeping included), its busy fraction, and
training steps/s and groups/s end to end. Sweep 1: 2 agents, 1 -> 256 actors. Sweep 2:
16 actors, 2 -> 8 agents. docs/scaling.md turns the figures into the largest cluster
one broker can feed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml
import zmq

HERE = Path(__file__).resolve().parent
SPAWN = mp.get_context("spawn")
G, PROMPT, RESPONSE, VOCAB, LEASES_PER_REQUEST = 8, 128, 256, 32_000, 2


def write_config(work: Path, agents: int, actors: int, steps: int, batch_groups: int) -> Path:
    """A run config for `agents` agents, each with its own (fake) model folder."""
    from drmas.config import config_dict, load_config

    base = config_dict(
        load_config(
            [
                f"group_size={G}",
                f"batch_groups={batch_groups}",
                f"train.steps={steps}",
                "val.every=0",
                "algorithm.max_staleness=1000000",
                f"sampling.max_new_tokens={RESPONSE}",
                f"broker.max_connections_per_host={actors + agents + 16}",
                "run.samples_every=0",
            ]
        )
    )
    model_dir = work / "model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    template = base["models"]["solver"]
    template["warmstart"]["steps"] = 0
    base["models"] = {f"m{i}": {**template, "path": str(model_dir)} for i in range(agents)}
    base["agents"] = {f"a{i}": {"model": f"m{i}"} for i in range(agents)}
    base["workflow"]["target"] = f"{HERE / 'scale_team.py'}:Chain{agents}"
    base["workflow"]["name"] = f"chain{agents}"
    path = work / f"config-{agents}-{actors}.yaml"
    path.write_text(yaml.safe_dump(base))
    load_config([], str(path))  # refused here, not in the broker, if anything is wrong
    return path


def broker_main(cfg_path: str, ready: mp.Queue, out: str) -> None:
    from drmas.broker.server import BrokerServer
    from drmas.config import load_config

    server = BrokerServer(load_config([], cfg_path), None)
    ready.put(server.address)
    server.serve(max_seconds=600)
    summary = server.cpu.summary(time.monotonic())
    Path(out).write_text(json.dumps({"cpu": summary, "counters": dict(server.state.counters)}))


class Client:
    def __init__(self, ctx: zmq.Context, address: str, cid: str) -> None:
        self.cid = cid
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, cid.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.next_beat = 0.0
        self.wake_at = 0.0  # a retry scheduled for later (0: none)
        self.done = False


def group_frame(agents: int) -> tuple[list, bytes, bytes, bytes]:
    """The headers and buffers of one group (the same for every lease)."""
    from drmas.protocol.messages import EpisodeHeader, StepHeader

    rng = np.random.default_rng(0)
    steps = [StepHeader(f"a{i}", f"m{i}", PROMPT, RESPONSE, 0, True, "stop") for i in range(agents)]
    episodes = [EpisodeHeader(steps, float(e % 2)) for e in range(G)]
    n = G * agents
    prompt = rng.integers(0, VOCAB, n * PROMPT).astype("<i4").tobytes()
    response = rng.integers(0, VOCAB, n * RESPONSE).astype("<i4").tobytes()
    logprobs = (-rng.random(n * RESPONSE)).astype("<f4").tobytes()
    return episodes, prompt, response, logprobs


def drive(address: str, agents: int, actors: int, steps: int) -> dict:
    """Run the simulated actors and learners until the broker says training is done."""
    from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode
    from drmas.protocol.messages import (
        Accepted,
        BatchRequest,
        BatchShard,
        Goodbye,
        GroupResult,
        Heartbeat,
        Hello,
        LeaseRequest,
        Leases,
        NoBatch,
        Shutdown,
        StepReport,
        Welcome,
    )

    episodes, prompt, response, logprobs = group_frame(agents)
    models = [f"m{i}" for i in range(agents)]
    ctx = zmq.Context()
    sim_actors = [Client(ctx, address, f"actor-{i}") for i in range(actors)]
    learners = {m: Client(ctx, address, f"learner-{m}-0") for m in models}
    version = dict.fromkeys(models, 0)
    poller = zmq.Poller()
    for c in [*sim_actors, *learners.values()]:
        poller.register(c.sock, zmq.POLLIN)
    for c in sim_actors:
        c.sock.send(encode(Hello("actor", c.cid, PROTOCOL_VERSION, models)))
    for m, c in learners.items():
        c.sock.send(encode(Hello("learner", c.cid, PROTOCOL_VERSION, [m])))
    by_sock = {c.sock: c for c in [*sim_actors, *learners.values()]}
    model_of = {c.cid: m for m, c in learners.items()}
    pending: dict[str, int] = dict.fromkeys((c.cid for c in sim_actors), 0)
    beat = 1.0
    start = cpu0 = 0.0
    first_step_at = 0.0
    groups = 0
    deadline = time.monotonic() + 600
    while not all(c.done for c in learners.values()):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError("the simulated run did not finish in 600 s")
        for c in sim_actors:
            if c.done:
                continue
            if c.next_beat and now >= c.next_beat:
                c.sock.send(encode(Heartbeat(c.cid, {})))
                c.next_beat = now + beat
            if c.wake_at and now >= c.wake_at:
                c.wake_at = 0.0
                c.sock.send(encode(LeaseRequest(c.cid, LEASES_PER_REQUEST, {})))
        for m, c in learners.items():
            if c.wake_at and now >= c.wake_at and not c.done:
                c.wake_at = 0.0
                c.sock.send(encode(BatchRequest(c.cid, m, 0, 1, version[m])))
        for sock, _ in poller.poll(5):
            c = by_sock[sock]  # type: ignore[index]
            msg = decode_from_broker(sock.recv())
            now = time.monotonic()
            if isinstance(msg, Welcome):
                beat = msg.heartbeat_interval_s
                if not start:
                    start, cpu0 = now, time.process_time()
                c.next_beat = now + beat
                c.wake_at = now  # actors: ask for leases; learners: ask for a batch
            elif isinstance(msg, Leases):
                for lease in msg.leases:
                    result = GroupResult(
                        c.cid,
                        lease.lease_id,
                        lease.group_id,
                        episodes,
                        prompt,
                        response,
                        logprobs,  # type: ignore[arg-type]
                    )
                    c.sock.send(encode(result))
                pending[c.cid] += len(msg.leases)
                if not msg.leases:
                    c.wake_at = now + max(msg.retry_after_s, 0.01)
            elif isinstance(msg, Accepted):
                groups += msg.accepted
                pending[c.cid] -= 1
                if pending[c.cid] == 0:
                    c.wake_at = now
            elif isinstance(msg, BatchShard):
                m = model_of[c.cid]
                version[m] += 1
                first_step_at = first_step_at or now
                c.sock.send(encode(StepReport(m, version[m], {})))
                c.sock.send(encode(BatchRequest(c.cid, m, 0, 1, version[m])))
            elif isinstance(msg, NoBatch):
                if msg.done:
                    c.done = True
                    c.sock.send(encode(Goodbye(c.cid)))
                else:
                    c.wake_at = now + msg.retry_after_s
            elif isinstance(msg, Shutdown):
                c.done = True
    end = time.monotonic()
    generator_cpu = time.process_time() - cpu0
    for c in sim_actors:
        c.sock.send(encode(Goodbye(c.cid)))
    time.sleep(0.2)
    for c in by_sock.values():
        c.sock.close(0)
    ctx.term()
    wall = end - start
    return {
        "wall_s": wall,
        "steps_per_s": steps / wall,
        "groups_accepted": groups,
        "groups_per_s": groups / wall,
        "response_tokens_per_s": groups * G * agents * RESPONSE / wall,
        "generator_cpu_s": generator_cpu,
    }


def one_run(work: Path, agents: int, actors: int, steps: int, batch_groups: int) -> dict:
    cfg_path = write_config(work, agents, actors, steps, batch_groups)
    out = work / f"broker-{agents}-{actors}.json"
    ready: mp.Queue = SPAWN.Queue()
    proc = SPAWN.Process(target=broker_main, args=(str(cfg_path), ready, str(out)))
    proc.start()
    try:
        address = ready.get(timeout=120)
        driven = drive(address, agents, actors, steps)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
    broker = json.loads(out.read_text())
    cpu = broker["cpu"]
    groups = max(driven["groups_accepted"], 1)
    return {
        "agents": agents,
        "actors": actors,
        "train_steps": steps,
        "batch_groups": batch_groups,
        **driven,
        "broker_busy_fraction": cpu["cpu_s"] / driven["wall_s"],
        "broker_cpu_us_per_group": cpu["cpu_s"] / groups * 1e6,
        "broker_cpu_by_kind": cpu["by_kind"],
        "groups_invalid": broker["counters"].get("groups_invalid", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actors", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--agents", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-groups", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/broker_scale.json")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        sweeps = [(2, n) for n in args.actors] + [(a, 16) for a in args.agents if a != 2]
        for agents, actors in sweeps:
            run = one_run(Path(tmp), agents, actors, args.steps, args.batch_groups)
            runs.append(run)
            print(
                json.dumps({k: v for k, v in run.items() if k != "broker_cpu_by_kind"}),
                flush=True,
            )
    result = {
        "what": "one broker against simulated actors and learners (no generation or "
        "training cost): its CPU per message and steps/s",
        "cpus": len(os.sched_getaffinity(0)),
        "group": {"episodes": G, "prompt_tokens": PROMPT, "response_tokens": RESPONSE},
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
