"""The broker's own CPU time, per message type: how much one broker can feed.

The broker is one Python thread. `CpuBook` adds up the thread CPU seconds spent on each
kind of message it handles (`group_result`, `lease_request`, `batch_request` – which
includes cutting the batch and computing advantages –, `heartbeat`, ...) and on its
housekeeping (`reap`: dropping silent actors, expiring leases, flushing transcripts),
next to the wall seconds it has been serving. broker_summary.json gets the totals
(`cpu`), each metrics.jsonl step line the broker's busy fraction since the previous line
(`broker/busy`), and `drmas report` shows both. docs/scaling.md turns the per-message
figures into the largest cluster one broker can feed.

Cost: two `time.thread_time()` calls per message, well under 1 % of a group's handling.
"""

from __future__ import annotations

import time
from collections import defaultdict


class CpuBook:
    def __init__(self) -> None:
        self.started = time.monotonic()
        self.cpu_s: dict[str, float] = defaultdict(float)
        self.count: dict[str, int] = defaultdict(int)
        self._line_cpu = 0.0
        self._line_at = self.started

    def add(self, kind: str, seconds: float) -> None:
        self.cpu_s[kind] += seconds
        self.count[kind] += 1

    def busy_since_last_line(self, now: float) -> float:
        """The fraction of the wall seconds since the previous call spent on CPU."""
        total = sum(self.cpu_s.values())
        span = now - self._line_at
        busy = (total - self._line_cpu) / span if span > 0 else 0.0
        self._line_cpu, self._line_at = total, now
        return busy

    def summary(self, now: float) -> dict[str, object]:
        """Per kind: count, CPU seconds, microseconds each; and the whole busy fraction."""
        wall = max(now - self.started, 1e-9)
        total = sum(self.cpu_s.values())
        return {
            "wall_s": wall,
            "cpu_s": total,
            "busy_fraction": total / wall,
            "by_kind": {
                kind: {
                    "count": self.count[kind],
                    "cpu_s": seconds,
                    "us_each": seconds / max(self.count[kind], 1) * 1e6,
                }
                for kind, seconds in sorted(self.cpu_s.items(), key=lambda kv: -kv[1])
            },
        }
