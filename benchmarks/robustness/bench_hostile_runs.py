"""Whole runs under attack: does one connection that is not a learner stop or stall a run?

    python benchmarks/robustness/bench_hostile_runs.py [--out benchmarks/results/hostile_runs.json] [--cache DIR] [--only seat,identity] [--timeout S]

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

And the whole-run attacks of issue #47 (round four), each by a client that holds the run's
actor secret (a compromised or buggy actor) but for `collision`:

- `collision`: 8 connections take the routing ids an unseeded libzmq hands out first
  (0x00 + 0x6B8B4567 + n) and send one frame each (the broker used to abort: exit -6);
- `flood`: 256 actor connections from this host, each welcomed and then silent, holding no
  lease (they used to fill broker.max_connections_per_host and keep the learner out: exit 1);
- `hoarder`: a fake actor asks for 256 leases every 0.5 s, claiming the newest versions it
  was told of, never returns a group, and says Hello again when dropped (one used to take
  272 leases, and the run made no step in 240 s);
- `ok_liar`: a fake actor answers every join at once with WeightsLoaded(ok) and never
  checks in at the roll call (one was never dropped: 12 joins missed);
- `rejoiner`: a fake actor never joins a publish and says Hello again each time it is
  dropped (it used to start with a clean record every time: 17 joins missed);
- `roll_call_squatter`: a fake actor checks in at each roll call it is sent, through the
  learner's store with its join's token, and never joins the group (every publish of the
  model used to wait 65 s; 10 failed, and it was never dropped).

Each case records the run's exit code, its wall time and the ratio to the baseline
(target <= 1.5x), the attacker's answers and the broker's counters that tell what
happened (refusals, joins missed, actors dropped). A run still going after --timeout
seconds is stopped with SIGTERM (so the broker still writes its counters) and recorded as
timed out.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

import zmq  # noqa: E402

from benchmarks.provenance import git_state  # noqa: E402
from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode  # noqa: E402
from drmas.protocol.messages import (  # noqa: E402
    ErrorReply,
    Goodbye,
    Heartbeat,
    Hello,
    JoinWeightGroup,
    LeaseRequest,
    Leases,
    WeightsLoaded,
    Welcome,
)
from drmas.transports.learner_secret import actor_proof  # noqa: E402
from drmas.transports.weights.layout import WeightSyncError  # noqa: E402
from drmas.transports.weights.membership import answer_roll  # noqa: E402

MODELS = ("solver", "verifier")
RUN = ("train.steps=6", "val.every=6", "train.progress=false")
COUNTERS = ("refused/forbidden", "refused/unknown_client", "weight_joins_missed",
            "actors_never_joined", "actors_left", "learners_lost", "refused/bad_frame",
            "connections_refused", "dropped/host_cap_idle", "dropped/unwelcomed_cap",
            "refused/unwelcomed_cap", "actors_joined", "actors_lost", "leases_issued",
            "leases_capped", "leases_reissued", "weight_loads_unexpected",
            "weight_publishes_failed", "weight_republishes")  # fmt: skip
# libc's first rand() unseeded: an unseeded libzmq's first routing id was 0x00 + it
UNSEEDED_FIRST_ID = 0x6B8B4567
FLOOD = 256  # broker.max_connections_per_host


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


def collision(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    """Takes the routing ids an unseeded libzmq gives out first, each with one frame."""
    ids = [b"\x00" + (UNSEEDED_FIRST_ID + n).to_bytes(4, "big") for n in range(8)]
    held, seen = [Client(address, i) for i in ids], Counter[str]()
    for client in held:
        client.sock.send(b"squat")
    for client in held:  # an undecodable frame: refused bad_frame, the broker lives on
        reply = decode_from_broker(client.sock.recv()) if client.sock.poll(5000) else None
        seen[answer(reply)] += 1
    seen["ids held"] = len(held)
    stop.wait()
    return seen


def flood(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    """FLOOD actor connections from this host, each welcomed one after the other (so that
    none counts against broker.max_unwelcomed_connections for long), then silent."""
    held, seen = [], Counter[str]()
    for n in range(FLOOD):
        client = Client(address)
        seen[answer(client.ask(actor_hello(run_dir, f"flood-{n}"), timeout=2.0))] += 1
        held.append(client)
    stop.wait()
    return seen


Handler = Callable[[Client, str, Any, Counter[str]], None]


def play_actor(
    address: str, stop: threading.Event, run_dir: Path, cid: str, on: Handler, rejoin: bool = False
) -> Counter[str]:
    """A fake actor with the actor secret: Hello, then every 0.5 s `on(client, cid, None,
    seen)` once welcomed and a heartbeat, and `on` for each message the broker sent, each
    counted; with `rejoin` it says Hello again each time the broker has dropped it."""
    client, seen, hello = Client(address), Counter[str](), actor_hello(run_dir, cid)
    client.sock.send(encode(hello))
    greeted = False
    while not stop.wait(0.5):
        if greeted:
            on(client, cid, None, seen)
        client.sock.send(encode(Heartbeat(cid)))
        while client.sock.poll(0):
            msg = decode_from_broker(client.sock.recv())
            seen[answer(msg) if isinstance(msg, Welcome | ErrorReply) else type(msg).__name__] += 1
            if isinstance(msg, Welcome):
                greeted, cid = True, msg.client_id or cid
            forgotten = isinstance(msg, ErrorReply) and msg.code == "unknown_client"
            if rejoin and greeted and forgotten:
                client.sock.send(encode(hello))  # the replies to what it sent before are
                greeted = False  # still coming: one Hello until the next Welcome
            on(client, cid, msg, seen)
    return seen


def hoarder(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    claimed: dict[str, int] = {}  # the newest version of each model it was told of
    held = 0  # leases taken since its last Welcome: it returns none

    def on(client: Client, cid: str, msg: Any, seen: Counter[str]) -> None:
        nonlocal held
        if msg is None:
            client.sock.send(encode(LeaseRequest(cid, 256, dict(claimed))))
        elif isinstance(msg, Welcome):
            claimed.update(msg.model_versions)
            held = 0
        elif isinstance(msg, JoinWeightGroup):
            claimed[msg.model] = max(claimed.get(msg.model, 0), msg.version)
        elif isinstance(msg, Leases):
            held += len(msg.leases)
            seen["leases taken"] += len(msg.leases)
            seen["validation leases taken"] += sum(lease.is_eval for lease in msg.leases)
            seen["most held at once"] = max(seen["most held at once"], held)

    return play_actor(address, stop, run_dir, "hoarder", on, rejoin=True)


def ok_liar(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    def on(client: Client, cid: str, msg: Any, seen: Counter[str]) -> None:
        if isinstance(msg, JoinWeightGroup):  # "loaded", at once, never having checked in
            client.sock.send(encode(WeightsLoaded(cid, msg.model, msg.version, 0.1)))
            seen["ok sent"] += 1

    return play_actor(address, stop, run_dir, "ok-liar", on)


def rejoiner(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    return play_actor(address, stop, run_dir, "rejoiner", lambda *_: None, rejoin=True)


def roll_call_squatter(address: str, stop: threading.Event, run_dir: Path) -> Counter[str]:
    """Checks in at the roll call of each join it is sent, on a thread of its own (so it
    heartbeats meanwhile and checks in at both models' publishes), and never joins."""
    outcomes: queue.SimpleQueue[str] = queue.SimpleQueue()

    def check_in(join: JoinWeightGroup) -> None:
        host, port = join.store_address.rsplit(":", 1)
        try:
            client = dist.TCPStore(host, int(port), is_master=False,
                                   timeout=timedelta(seconds=10), wait_for_workers=False)  # fmt: skip
            store = dist.PrefixStore(join.group_name, client)
            answer_roll(store, join.group_name, join.version, join.token, join.rank, 10.0)
            outcomes.put("checked in")
        except (WeightSyncError, RuntimeError) as e:  # left out, or the roll call was over
            outcomes.put(f"roll call: {type(e).__name__}")

    def on(client: Client, cid: str, msg: Any, seen: Counter[str]) -> None:
        if isinstance(msg, JoinWeightGroup):
            threading.Thread(target=check_in, args=(msg,), daemon=True).start()
        while not outcomes.empty():
            seen[outcomes.get()] += 1

    return play_actor(address, stop, run_dir, "roll-call-squatter", on)


CASES: dict[str, Callable[[str, threading.Event, Path], Counter[str]] | None] = {
    "baseline": None, "seat": seat, "identity": identity, "fake_actor": fake_actor,
    "hello_goodbye": hello_goodbye, "stranger": stranger, "collision": collision,
    "flood": flood, "hoarder": hoarder, "ok_liar": ok_liar, "rejoiner": rejoiner,
    "roll_call_squatter": roll_call_squatter,
}  # fmt: skip


def run_case(name: str, cache: str, timeout: float) -> dict[str, Any]:
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
    timed_out = False
    try:
        out, _ = train.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # a stalled run: stopped, so the broker still
        timed_out = True  # writes its counters, and the cases after it still run
        train.terminate()
        out, _ = train.communicate(timeout=300)
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
        "timed_out": timed_out,
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
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    args = p.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="drmas-hostile-cache-")
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    names = ["baseline", *(n for n in CASES if n != "baseline" and (not only or n in only))]
    # the first run builds the model when the cache is fresh: a warm-up, not the baseline
    warm = run_case("baseline", cache, args.timeout)
    out: dict[str, Any] = {"command": " ".join(sys.argv), **git_state(),
                           "run": list(RUN), "warm_up": warm, "cases": {}}  # fmt: skip
    for name in names:
        out["cases"][name] = result = run_case(name, cache, args.timeout)
        result["wall_ratio"] = round(result["wall_s"] / out["cases"]["baseline"]["wall_s"], 2)
        print(name, json.dumps({k: v for k, v in result.items() if k != "output_tail"}), flush=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 for r in out["cases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
