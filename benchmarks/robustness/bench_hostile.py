"""The hostile-client cases against the broker: what each costs now.

    python benchmarks/robustness/bench_hostile.py [--out benchmarks/results/hostile.json] [--parts 8000000]

Two parts. `attacks`: the attacks of issue #25 (1: many empty parts before Hello, and 1b
after a Hello as an actor, whose allowance of unread bytes is larger; 2: huge
valid messages before and after Hello, 3: peers that never read their replies, 5: twelve
loopback aliases over the per-host cap, reconnecting every 100 ms; and of issue #36,
whose connections each stay within their own allowance, so only the broker's budget for
all of them together, broker.max_held_bytes, bounds them: 6, 240 connections before Hello
each leaving a message of 23,000 empty parts unfinished; 7, three actors each leaving one
of 11 M parts) against a real broker
process on loopback (`BrokerServer.serve`), each measured by the broker's resident memory
(before, its peak during the attack: VmHWM reset through /proc/PID/clear_refs, and after),
its CPU seconds, its counters, an honest actor in its own process asking for a lease
every 100 ms throughout (answered or not, and how long it waited), and an honest
`drmas status` (a fresh observer's StatusRequest every 0.5 s, goal: answered within 1 s). `handle`: the earlier
cases sent through `BrokerServer.handle` in this process (no socket in between), with the
refusals, wall time, largest reply and log line, memory and the sizes of the state that
used to grow.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # benchmarks.* when run as a script

import msgpack  # noqa: E402
import zmq  # noqa: E402

from benchmarks.provenance import git_state  # noqa: E402
from drmas.broker.server import BrokerServer  # noqa: E402
from drmas.config import load_config  # noqa: E402
from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode  # noqa: E402
from drmas.protocol.messages import (  # noqa: E402
    ErrorReply,
    Heartbeat,
    Hello,
    LeaseRequest,
    LeaseReturn,
    Leases,
    PublishRequest,
    StatusReply,
    StatusRequest,
    StepReport,
    WeightsLoaded,
    Welcome,
)
from tests.fixtures.router import Recorder  # noqa: E402
from tests.fixtures.zmtp import EMPTY_PART, RawZmtp, frame  # noqa: E402


class Frame:
    def __init__(self, data: bytes) -> None:
        self.bytes = data
        self.buffer = memoryview(data)


def rss_mb() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


class LongestLine(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.longest = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.longest = max(self.longest, len(record.getMessage()))


def handle_cases() -> dict:
    """The earlier cases through BrokerServer.handle in this process."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps({"vocab_size": 64}))
    cfg = load_config([f"models.solver.path={tmp}", f"models.verifier.path={tmp}",
                       "train.steps=30", "val.every=10", "val.num_tasks=64"])  # fmt: skip
    server = BrokerServer(cfg, None)
    replies = {"count": 0, "errors": 0, "largest": 0}  # not kept: this process is measured

    def record(frames: list[bytes], flags: int = 0) -> None:
        replies["count"] += 1
        replies["largest"] = max(replies["largest"], len(frames[1]))
        replies["errors"] += isinstance(decode_from_broker(frames[1]), ErrorReply)

    server.connections.close()
    server.sock.close(linger=0)
    server.sock = Recorder(record)
    lines = LongestLine()
    logging.getLogger("drmas.broker").addHandler(lines)
    logging.getLogger("drmas.broker").setLevel(logging.DEBUG)

    def send(cid: str, msg: object) -> None:
        server.handle([Frame(cid.encode()), Frame(msg if isinstance(msg, bytes) else encode(msg))])

    send("victim", Hello("actor", "victim", PROTOCOL_VERSION, ["solver", "verifier"]))
    send("forger", Hello("actor", "forger", PROTOCOL_VERSION, ["solver", "verifier"]))
    send("L", Hello("learner", "L", PROTOCOL_VERSION, ["solver"]))
    nested = (b"\x82" + msgpack.packb("x") + b"\x91" * 1000 + b"\xc0"
              + msgpack.packb("type") + msgpack.packb("status_request"))  # fmt: skip
    cases = {
        "nested_1kb_frame_before_hello": [("x", nested)],
        "actor_publish_request_own_store": [("forger", PublishRequest("solver", 0, "6.6.6.6:1"))],
        "actor_step_report_v2e6": [("forger", StepReport("solver", 2_000_000, {}))],
        "learner_step_report_v2e6": [("L", StepReport("solver", 2_000_000, {}))],
        "heartbeat_v1e6": [("victim", Heartbeat("victim", {"solver": 1_000_000}))],
        "weights_loaded_x200k": (
            ("victim", WeightsLoaded("victim", "solver", i % 50, 0.1, True, "", "d" * 16))
            for i in range(200_000)
        ),
        "learner_hellos_x3000_new_ids": (
            (f"L{i}", Hello("learner", f"L{i}", PROTOCOL_VERSION, ["verifier"]))
            for i in range(3000)
        ),
        "lease_return_20mb": [("victim", LeaseReturn("victim", list(range(2_000_000)), "x" * 2_000_000))],
        "hello_1m_unknown_models": [
            ("m", Hello("actor", "m", PROTOCOL_VERSION, [f"model{i}" for i in range(1_000_000)]))
        ],
    }  # fmt: skip
    out: dict = {"cases": {}}
    st = server.state
    for name, messages in cases.items():
        replies.update(count=0, errors=0, largest=0)
        lines.longest = 0
        before_counters = dict(st.counters)
        gc.collect()
        before = rss_mb()
        start = time.perf_counter()
        count = 0
        for cid, msg in messages:
            send(cid, msg)
            count += 1
        seconds = time.perf_counter() - start
        gc.collect()
        refused = {
            k: v - before_counters.get(k, 0)
            for k, v in st.counters.items()
            if k.startswith("refused/") and v != before_counters.get(k, 0)
        }
        out["cases"][name] = {
            "messages": count,
            "refused": refused,
            "seconds": round(seconds, 3),
            "rss_mb_before": round(before, 1),
            "rss_mb_after": round(rss_mb(), 1),
            "largest_reply_bytes": replies["largest"],
            "longest_log_line_chars": lines.longest,
            "error_replies": replies["errors"],
            "state_after": {
                "learners": len(st.learners),
                "loaded_digest_keys": len(st.weights.loaded_digest),
                "pending_metric_steps": len(st.metrics.pending),
                "eval_queue": len(st.validation.queue),
                "versions": dict(st.versions),
                "actor_versions": {a.client_id: dict(a.versions) for a in st.table.actors.values()},
            },
        }
        print(name, json.dumps(out["cases"][name]["refused"]), f"{seconds:.2f}s",
              f"rss {before:.0f}->{rss_mb():.0f} MB", flush=True)  # fmt: skip
    out["refused/internal"] = st.counters["refused/internal"]
    server.ctx.term()
    return out


# ------------------------------------------------------------ attacks on a real broker
def broker_process(folder: str, conn: Any) -> None:
    """The broker under attack, in its own process: serves until SIGTERM."""
    logging.basicConfig(level=logging.ERROR)
    cfg = load_config([f"models.solver.path={folder}", f"models.verifier.path={folder}",
                       "train.steps=1000", "val.every=0"])  # fmt: skip
    server = BrokerServer(cfg, None)
    server.install_signal_handlers()
    conn.send((server.address, server.intake.limits.group))
    server.serve(max_seconds=1800)


def honest_actor(address: str, stop: Any, conn: Any) -> None:
    """An actor in its own process: Hello, then a LeaseRequest every 100 ms, each waited
    for up to 30 s. Sends back [(time sent, seconds to the reply or None)]."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"honest")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    log: list[tuple[float, float | None]] = []

    def ask(msg: object) -> float | None:
        sent = time.time()
        sock.send(encode(msg))
        while sock.poll(30_000):
            reply = decode_from_broker(sock.recv())
            if isinstance(reply, (Welcome, Leases)):
                return time.time() - sent
        return None

    ask(Hello("actor", "honest", PROTOCOL_VERSION, ["solver", "verifier"]))
    while not stop.is_set():
        sent = time.time()
        log.append((sent, ask(LeaseRequest("honest", 1, {}))))
        time.sleep(max(0.0, 0.1 - (time.time() - sent)))
    conn.send(log)
    sock.close()
    ctx.term()


def honest_observer(address: str, stop: Any, conn: Any) -> None:
    """`drmas status` as an operator runs it, in its own process: every 0.5 s a fresh
    observer connection (status is rate-limited per peer) sends a StatusRequest and waits
    up to 30 s. Sends back [(time sent, seconds to the StatusReply or None)]."""
    ctx = zmq.Context()
    log: list[tuple[float, float | None]] = []
    n = 0
    while not stop.is_set():
        n += 1
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"observer-{n}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sent, waited = time.time(), None
        sock.send(encode(StatusRequest()))
        while sock.poll(max(1, int(1000 * (30 - (time.time() - sent))))):
            if isinstance(decode_from_broker(sock.recv()), StatusReply):
                waited = time.time() - sent
                break
        sock.close()
        log.append((sent, waited))
        time.sleep(max(0.0, 0.5 - (time.time() - sent)))
    conn.send(log)
    ctx.term()


class Broker:
    """The broker process as the bench sees it: memory, CPU, counters."""

    def __init__(self, pid: int, address: str, ctx: zmq.Context) -> None:
        self.pid, self.address, self.ctx = pid, address, ctx
        self.asks = 0

    def status(self, key: str) -> int:
        return int(Path(f"/proc/{self.pid}/status").read_text().split(f"{key}:")[1].split()[0])

    def cpu_s(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def counters(self) -> dict[str, int]:
        self.asks += 1  # a fresh observer each time: status is rate-limited per peer
        sock = self.dealer(f"ops-{self.asks}")
        try:
            sock.send(encode(StatusRequest()))
            assert sock.poll(120_000), "the broker stopped answering StatusRequest"
            reply = decode_from_broker(sock.recv())
            assert isinstance(reply, StatusReply), reply
            return dict(reply.counters)
        finally:
            sock.close(linger=0)

    def dealer(self, identity: str, **opts: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity.encode())
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in opts.items():
            sock.setsockopt(getattr(zmq, name), value)
        sock.connect(self.address)
        return sock


def attack_many_parts(broker: Broker, parts: int) -> dict:
    """1: `parts` empty parts before any Hello, then 1 M more, then a StatusRequest. The
    attacker's side counts the times the broker shut its connection (its DEALER then
    reconnects, as any ZeroMQ client does, without the rest of the message)."""
    sock = broker.dealer("parts")
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    shut, replies = 0, []
    for count in (parts, 1_000_000):
        sock.send_multipart([b""] * count + [b"x"])
        events = dict(poller.poll(120_000))  # a reply, or the connection shut
        if sock in events:
            replies.append(getattr(decode_from_broker(sock.recv()), "code", None))
        while monitor.poll(0):
            monitor.recv_multipart()
            shut += 1
    sock.send(encode(StatusRequest()))
    later = decode_from_broker(sock.recv()) if sock.poll(15_000) else None
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
    return {"replies": replies, "connections_shut": shut,
            "status_after": type(later).__name__ if later is not None else None}  # fmt: skip


def raw_actor(broker: Broker, name: str) -> RawZmtp:
    """A raw ZMTP client (tests/fixtures/zmtp.py: as fast as the wire, no pyzmq loop per
    part) welcomed as an actor that holds no lease."""
    raw = RawZmtp(broker.address)
    raw.send(frame(encode(Hello("actor", name, PROTOCOL_VERSION, ["solver", "verifier"]))))
    assert isinstance(decode_from_broker(raw.recv_frame()), Welcome)
    return raw


def attack_parts_as_actor(broker: Broker, parts: int) -> dict:
    """1b: an actor sends `parts` empty parts in one message: its allowance of unread
    bytes is an actor's (drmas/broker/wire_watch.py)."""
    raw = raw_actor(broker, "parts-actor")
    flood = EMPTY_PART * parts + frame(b"x")
    start = time.monotonic()
    shut, got = False, b""
    try:
        raw.sock.settimeout(10)
        try:
            raw.send(flood)
        except OSError:  # shut while it sent: the broker takes no more bytes
            shut = True
            raise
        raw.sock.settimeout(60)
        while b"too_many_parts" not in got:  # the refusal if it is read
            data = raw.sock.recv(65536)
            if not data:
                shut = True
                break
            got += data
    except ConnectionResetError:
        shut = True
    except OSError:
        pass
    finally:
        raw.close()
    return {"bytes_sent": len(flood), "connection_shut": shut,
            "refused_too_many_parts": b"too_many_parts" in got,
            "seconds": round(time.monotonic() - start, 2)}  # fmt: skip


def hold_unfinished(raws: list[RawZmtp], parts: int, hold_s: float) -> dict:
    """Each of `raws` sends `parts` empty parts of a message it never finishes, then holds
    its connection `hold_s` (or until the broker shuts it); then all close."""
    start = time.monotonic()
    cut = 0
    for raw in raws:
        raw.sock.settimeout(5.0)  # a connection the broker shut takes no more bytes
        try:
            raw.send(EMPTY_PART * parts)
        except OSError:
            cut += 1
    sent_s = time.monotonic() - start
    open_ = list(raws)
    while open_ and time.monotonic() - start < hold_s:
        open_ = [raw for raw in open_ if not raw.closed_by_peer(0)]
        time.sleep(0.05)
    for raw in raws:
        raw.close()
    return {"connections": len(raws), "parts_each": parts, "bytes_each": 2 * parts,
            "seconds_to_send": round(sent_s, 2), "held_s": hold_s, "cut_while_sending": cut,
            "shut_by_the_broker": len(raws) - len(open_)}  # fmt: skip


def attack_many_connections(broker: Broker) -> dict:
    """6: 240 connections before their Hello (those the broker closes during the handshake
    are counted), each leaving 23,000 empty parts (46 KB, just under a newcomer's 48 KiB
    allowance) unfinished for 10 s, then leaving."""
    raws, closed = [], 0
    for _ in range(240):
        try:
            raws.append(RawZmtp(broker.address, timeout_s=5.0))
        except OSError:  # ConnectionError: closed by the broker (or a handshake timeout)
            closed += 1
    return {"closed_during_handshake": closed, **hold_unfinished(raws, 23_000, 10.0)}


def attack_actors_many_parts(broker: Broker) -> dict:
    """7: three actors, each leaving 11 M empty parts (22 MB, under an actor's allowance)
    unfinished for 15 s, then leaving."""
    raws = [raw_actor(broker, f"parts-actor-{i}") for i in range(3)]
    return hold_unfinished(raws, 11_000_000, 15.0)


def attack_huge_messages(broker: Broker, group_bytes: int) -> dict:
    """2: LeaseReturns of one-byte lease ids: 64 MB (over the socket's ceiling) and just
    under the ceiling before Hello, then 1 MB and 900 KB from a registered actor."""
    replies = {}
    for name, ids, hello in (("64mb_before_hello", 64_000_000, False),
                             ("under_ceiling_before_hello", group_bytes - 1024, False),
                             ("1mb_after_hello", 1_100_000, True),
                             ("900kb_after_hello", 900_000, True)):  # fmt: skip
        sock = broker.dealer(f"huge-{name}")
        if hello:
            sock.send(
                encode(Hello("actor", f"huge-{name}", PROTOCOL_VERSION, ["solver", "verifier"]))
            )
            assert sock.poll(30_000) and isinstance(decode_from_broker(sock.recv()), Welcome)
        frame = msgpack.packb({"type": "lease_return", "client_id": f"huge-{name}",
                               "lease_ids": [1] * ids})  # fmt: skip
        sock.send(frame)
        reply = decode_from_broker(sock.recv()) if sock.poll(10_000) else None
        replies[name] = {"bytes": len(frame), "reply": getattr(reply, "code", None)}
        sock.close(linger=0)
    return replies


def attack_non_readers(broker: Broker) -> dict:
    """3: 4 connections that never read (libzmq takes 1 reply, a 4 KB kernel buffer), each
    sending 10,000 StatusRequests; then 4 more sending 10,000 LeaseReturns before Hello
    (an unknown_client reply each, not rate-limited)."""
    socks = []
    for i in range(8):
        sock = broker.dealer(f"deaf-{i}", RCVHWM=1, RCVBUF=4096, SNDHWM=20_000)
        msg = encode(StatusRequest()) if i < 4 else encode(LeaseReturn(f"deaf-{i}", []))
        for _ in range(10_000):
            sock.send(msg)
        socks.append(sock)
    time.sleep(5)  # let the broker work through them
    for sock in socks:
        sock.close(linger=0)
    return {"connections": 8, "messages_each": 10_000}


def attack_loopback_aliases(broker: Broker) -> dict:
    """5: 12 loopback aliases x 30 idle connections (360 against the cap of 256 per host),
    then each alias opens a new connection every 100 ms for 10 s, all of them refused."""
    host, port = broker.address.removeprefix("tcp://").rsplit(":", 1)
    aliases = [f"127.0.0.{i}" for i in range(2, 14)]

    def connect(src: str) -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=5, source_address=(src, 0))

    held = [connect(src) for src in aliases for _ in range(30)]
    storm, last = 0, []
    start = time.monotonic()
    cpu = broker.cpu_s()
    while time.monotonic() - start < 10:  # each alias reconnects as a ZeroMQ client would
        tick = time.monotonic()
        for s in last:
            s.close()
        last = [connect(src) for src in aliases]
        storm += len(last)
        time.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
    cpu = broker.cpu_s() - cpu
    for s in held + last:
        s.close()
    return {"held": len(held), "reconnects": storm, "broker_cpu_s_during_reconnects": round(cpu, 3)}


def run_attacks(parts: int, only: set[str] | None = None) -> dict:
    spawn = mp.get_context("spawn")
    folder = tempfile.mkdtemp()
    (Path(folder) / "config.json").write_text(json.dumps({"vocab_size": 64}))
    here, there = spawn.Pipe()
    proc = spawn.Process(target=broker_process, args=(folder, there))
    proc.start()
    address, group_bytes = here.recv()
    stop = spawn.Event()
    actor_here, actor_there = spawn.Pipe()
    actor = spawn.Process(target=honest_actor, args=(address, stop, actor_there))
    actor.start()
    observer_here, observer_there = spawn.Pipe()
    observer = spawn.Process(target=honest_observer, args=(address, stop, observer_there))
    observer.start()
    ctx = zmq.Context()
    broker = Broker(proc.pid or 0, address, ctx)
    time.sleep(2)
    cases = {"1_many_parts_before_hello": lambda: attack_many_parts(broker, parts),
             "1b_many_parts_after_hello_as_actor": lambda: attack_parts_as_actor(broker, parts),
             "2_huge_valid_messages": lambda: attack_huge_messages(broker, group_bytes),
             "3_peers_that_never_read": lambda: attack_non_readers(broker),
             "5_loopback_aliases_and_reconnects": lambda: attack_loopback_aliases(broker),
             "6_many_connections_each_within_its_allowance":
                 lambda: attack_many_connections(broker),
             "7_three_actors_each_within_its_allowance": lambda: attack_actors_many_parts(broker),
             }  # fmt: skip
    if only:
        cases = {name: attack for name, attack in cases.items()
                 if name.split("_")[0].rstrip("b") in only}  # fmt: skip
    out: dict = {"group_bytes_ceiling": group_bytes, "cases": {}}
    windows = {}
    try:
        for name, attack in cases.items():
            before_counters = broker.counters()
            time.sleep(1)
            Path(f"/proc/{proc.pid}/clear_refs").write_text("5")  # resets VmHWM
            rss_before, cpu, start = broker.status("VmRSS"), broker.cpu_s(), time.time()
            detail = attack()
            seconds = time.time() - start
            peak = broker.status("VmHWM")
            time.sleep(3)
            after = broker.counters()
            windows[name] = (start, time.time())
            out["cases"][name] = {
                "seconds": round(seconds, 2),
                "broker_cpu_s": round(broker.cpu_s() - cpu, 2),
                "rss_mb_before": round(rss_before / 1024, 1),
                "rss_mb_peak": round(peak / 1024, 1),
                "rss_mb_after": round(broker.status("VmRSS") / 1024, 1),
                "rss_growth_mb_peak": round((peak - rss_before) / 1024, 1),
                "rss_growth_mb_after": round((broker.status("VmRSS") - rss_before) / 1024, 1),
                "counters": {
                    k: v - before_counters.get(k, 0)
                    for k, v in after.items()
                    if v != before_counters.get(k, 0) and not k.startswith("leases")
                },
                "detail": detail,
            }
            print(name, json.dumps(out["cases"][name]), flush=True)
        time.sleep(3)  # the honest actor goes on after the last attack
    finally:
        stop.set()
        log = actor_here.recv() if actor_here.poll(60) else []
        actor.join(30)
        statuses = observer_here.recv() if observer_here.poll(60) else []
        observer.join(30)
        proc.terminate()
        proc.join(60)
        ctx.destroy(linger=0)
    honest_actor_served(out, windows, log)
    status_answered(out, windows, statuses)
    return out


def honest_actor_served(
    out: dict, windows: dict[str, tuple[float, float]], log: list[tuple[float, float | None]]
) -> None:
    """The honest actor's requests during each attack's window, and after the last one."""
    for name, (start, end) in windows.items():
        asked = [(t, s) for t, s in log if start <= t <= end]
        waits = [s for _, s in asked if s is not None]
        out["cases"][name]["honest_actor"] = {
            "lease_requests": len(asked), "answered": len(waits),
            "max_wait_s": round(max(waits, default=0.0), 3),
        }  # fmt: skip
    tail = [s for t, s in log if t > max((e for _, e in windows.values()), default=0.0)]
    out["honest_actor_after"] = {
        "lease_requests": len(tail),
        "answered": sum(s is not None for s in tail),
    }


def status_answered(
    out: dict, windows: dict[str, tuple[float, float]], log: list[tuple[float, float | None]]
) -> None:
    """The honest observer's StatusRequests during each attack's window (goal: each
    answered within 1 s)."""
    for name, (start, end) in windows.items():
        waits = [w for t, w in log if start <= t <= end]
        answered = [w for w in waits if w is not None]
        out["cases"][name]["honest_status"] = {
            "requests": len(waits), "answered": len(answered),
            "within_1s": sum(w <= 1.0 for w in answered),
            "max_wait_s": round(max(answered, default=0.0), 3),
        }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks/results/hostile.json"))
    p.add_argument("--parts", type=int, default=8_000_000, help="attack 1's empty parts")
    p.add_argument("--only", default="", help="attacks to run, e.g. 1,5 (then no `handle` "
                   "part; for a quick look, with --out elsewhere)")  # fmt: skip
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=open("/dev/null", "w"))  # noqa: SIM115
    only = {n.strip() for n in args.only.split(",") if n.strip()}

    out = {"command": f"python benchmarks/robustness/bench_hostile.py --parts {args.parts}"
                      + (f" --only {args.only}" if only else ""),
           **git_state(),
           "attacks": run_attacks(args.parts, only)}  # fmt: skip
    if not only:
        out["handle"] = handle_cases()
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
