"""Where an actor's wall time goes: generating (at least one leased group in flight),
waiting for leases (none in flight), loading weights (a publish being received and
loaded; generation is paused meanwhile). Kept by the actor loop (drmas/actors/main.py),
sent with every heartbeat (the broker turns them into per-step fractions in
metrics.jsonl) and written at exit to RUN_DIR/logs/<actor id>.time.json, read by
benchmarks/perf/bench_async.py and `drmas report`."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from drmas.protocol.messages import ACTOR_TIME_STATES as STATES


class TimeBook:
    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def tick(self, state: str) -> None:
        """Book the time since the previous tick to `state` (what the actor was doing)."""
        now = time.monotonic()
        self.seconds[state] += now - self.last
        self.last = now

    def totals(self) -> dict[str, float]:
        """Seconds per state so far, the current state's open interval left out."""
        return {state: self.seconds[state] for state in STATES}

    def summary(self) -> dict[str, float]:
        wall = time.monotonic() - self.start
        out = {"wall_s": wall, **{f"{s}_s": v for s, v in self.totals().items()}}
        out["busy_fraction"] = self.seconds["generating"] / wall if wall > 0 else 0.0
        return out

    def write(self, folder: Path, actor_id: str) -> Path:
        path = folder / f"{actor_id}.time.json"
        path.write_text(json.dumps(self.summary(), indent=2) + "\n")
        return path
