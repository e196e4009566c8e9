"""Whole runs under attack: does one connection that is not a learner stop or stall a run?

    python benchmarks/robustness/bench_hostile_runs.py [--out benchmarks/results/hostile_runs.json] [--cache DIR] [--only seat,identity]

The cases of issue #36 that bench_hostile.py cannot show on a broker alone, each a real
`drmas train` (the embedded default, 6 steps, one validation at the end, the model cache
shared) with one attacker beside it from the moment the broker answers, against the same
run without one (`baseline`):

- `seat`: a client says Hello for rank 0 of every model, with no proof of the run's
  learner secret, every 0.5 s until the run ends (it used to take a free seat first);
- `identity`: silent connections that hold the names of the learners and of actor-0 as
  their ZeroMQ identity (the real learner's Hello used to go unanswered);
- `stranger`: a client without the run's actor secret says Hello as an actor every second
  (refused: forbidden; it used to be welcomed and could lease);
- `fake_actor`: a client holding the actor secret says Hello as an actor of every model and keeps heartbeating,
  but never leases and never joins a weight publish (publishes used to wait for it);
- `hello_goodbye`: a client says Hello as an actor, then Goodbye at once.

Each case records the run's exit code, its wall time and the ratio to the baseline
(target <= 1.5x), the attacker's answers and the broker's counters that tell what
happened (refusals, joins missed, actors dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

import zmq  # noqa: E402

from benchmarks.provenance import git_state  # noqa: E402
from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode  # noqa: E402
from drmas.protocol.messages import ErrorReply, Goodbye, Heartbeat, Hello, Welcome  # noqa: E402
from drmas.transports.learner_secret import actor_proof  # noqa: E402

MODELS = ("solver", "verifier")
RUN = ("train.steps=6", "val.every=6", "train.progress=false")
COUNTERS = ("refused/forbidden", "refused/unknown_client", "weight_joins_missed",
            "actors_never_joined", "actors_left", "learners_lost")  # fmt: skip


def address_of(run_dir: Path, train: subprocess.Popen[str], timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and train.poll() is None:
        path = run_dir / "config.yaml"
        if path.is_file():
            return str(yaml.safe_load(path.read_text())["broker"]["address"])
        time.sleep(0.2)
    raise RuntimeError("drmas train wrote no config.yaml")


class Client:
    """A raw DEALER (its own identity only when given one)."""

    def __init__(self, address: str, identity: bytes = b"") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)

    def ask(self, msg: Any, timeout: float = 5.0) -> Any:
        self.sock.send(encode(msg))
        return decode_from_broker(self.sock.recv()) if self.sock.poll(int(timeout * 1000)) else None


def answer(reply: Any) -> str:
    if isinstance(reply, ErrorReply):
        return f"refused {reply.code}"
    return "welcome" if isinstance(reply, Welcome) else "no answer"


def seat(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    client, seen = Client(address), Counter[str]()
    while not stop.is_set():
        for model in MODELS:
            hello = Hello("learner", "squatter", PROTOCOL_VERSION, [model], rank=0, world_size=1)
            seen[answer(client.ask(hello))] += 1
        stop.wait(0.5)
    return seen


def identity(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    names = [f"learner-{m}-0" for m in MODELS] + ["actor-0"]
    held = [Client(address, name.encode()) for name in names]  # connected, and silent
    stop.wait()
    return Counter({"identities held": len(held)})


def actor_hello(run_dir: Path, cid: str) -> Hello:
    """An actor's Hello with the proof made from the run's actor secret: these fakes stand
    for a compromised or buggy actor that holds the run's actor key."""
    secret = (run_dir / "actor.secret").read_text().strip().encode()
    return Hello("actor", cid, PROTOCOL_VERSION, list(MODELS), proof=actor_proof(secret, cid))


def stranger(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    """A client without the actor secret that says Hello as an actor, again and again."""
    client, seen = Client(address), Counter[str]()
    while not stop.wait(1.0):
        seen[answer(client.ask(Hello("actor", "stranger", PROTOCOL_VERSION, list(MODELS))))] += 1
    return seen


def fake_actor(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    client, seen = Client(address), Counter[str]()
    seen[answer(client.ask(actor_hello(run_dir, "fake-actor")))] += 1
    while not stop.wait(1.0):
        client.sock.send(encode(Heartbeat("fake-actor")))
        while client.sock.poll(0):  # JoinWeightGroup and the like: read, never acted on
            seen[type(decode_from_broker(client.sock.recv())).__name__] += 1
    return seen


def hello_goodbye(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    client, seen = Client(address), Counter[str]()
    seen[answer(client.ask(actor_hello(run_dir, "brief-actor")))] += 1
    client.sock.send(encode(Goodbye("brief-actor", [], "leaving at once")))
    stop.wait()
    return seen


CASES: dict[str, Callable[[str, threading.Event, Path], Counter[str]] | None] = {
    "baseline": None, "seat": seat, "identity": identity, "fake_actor": fake_actor,
    "hello_goodbye": hello_goodbye, "stranger": stranger,
}  # fmt: skip


def run_case(name: str, cache: str) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"drmas-hostile-{name}-")) / "run"
    cmd = [sys.executable, "-m", "drmas.launch.cli", "train", *RUN, f"run.dir={run_dir}",
           f"run.cache_dir={cache}"]  # fmt: skip
    start = time.monotonic()
    train = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    attack, stop, seen = CASES[name], threading.Event(), Counter[str]()
    thread = None
    if attack is not None:
        address = address_of(run_dir, train)

        def go() -> None:
            seen.update(attack(address, stop, run_dir))

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
    try:
        out, _ = train.communicate(timeout=1800)
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
        if train.poll() is None:
            train.kill()
    wall = time.monotonic() - start
    summary_path = run_dir / "broker_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    counters = summary.get("counters", {})
    return {
        "exit_code": train.returncode,
        "wall_s": round(wall, 1),
        "done": summary.get("done"),
        "attacker": dict(seen),
        "counters": {k: counters.get(k, 0) for k in COUNTERS},
        "output_tail": out[-1500:] if train.returncode else "",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks/results/hostile_runs.json"))
    p.add_argument("--cache", default="", help="model cache (default: a fresh one, built once)")
    p.add_argument("--only", default="", help="cases besides the baseline, e.g. seat,identity")
    args = p.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="drmas-hostile-cache-")
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    names = ["baseline", *(n for n in CASES if n != "baseline" and (not only or n in only))]
    # the first run builds the model when the cache is fresh: a warm-up, not the baseline
    warm = run_case("baseline", cache)
    out: dict[str, Any] = {"command": " ".join(sys.argv), **git_state(),
                           "run": list(RUN), "warm_up": warm, "cases": {}}  # fmt: skip
    for name in names:
        out["cases"][name] = result = run_case(name, cache)
        result["wall_ratio"] = round(result["wall_s"] / out["cases"]["baseline"]["wall_s"], 2)
        print(name, json.dumps({k: v for k, v in result.items() if k != "output_tail"}), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in out["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
