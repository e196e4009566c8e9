"""The hostile-client cases against the broker's message handling: what each costs now.

    python benchmarks/bench_hostile.py [--out benchmarks/results/hostile.json]

Each case sends its frames through `BrokerServer.handle`, the function the broker loop
calls for every received frame (no socket in between, so the numbers are the broker's
own), and records: messages sent, messages refused (by code), wall time, the largest
reply and log line, the broker's resident memory before and after, and the sizes of the
state that used to grow (learner registrations, digest maps, pending metrics,
validation queue, versions).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import msgpack  # noqa: E402

from drmas.broker.server import BrokerServer  # noqa: E402
from drmas.config import load_config  # noqa: E402
from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode  # noqa: E402
from drmas.protocol.messages import (  # noqa: E402
    ErrorReply,
    Heartbeat,
    Hello,
    LeaseReturn,
    PublishRequest,
    StepReport,
    WeightsLoaded,
)
from tests.fixtures.router import Recorder  # noqa: E402


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(REPO / "benchmarks/results/hostile.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=open("/dev/null", "w"))  # noqa: SIM115
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
    out: dict = {"command": "python benchmarks/bench_hostile.py", "cases": {}}
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
    Path(args.out).write_text(json.dumps(out, indent=2))
    server.ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
