"""The run's metrics.jsonl, written by the broker (the one process that sees everything).

Line for step s (= model versions after s optimizer steps) is written once every model
has reported step s and finished publishing its weights. It holds:
- batch statistics (rewards, scores, advantages per agent, staleness; per agent, how
  many groups vary and the largest |advantage|: drmas/broker/variation.py);
- learner metrics (loss, grad norms, train_s, batch_wait_s, ...) and the publish's
  (`weight_sync_s/<model>`, `weight_sync_bytes/<model>`; on a LoRA base
  `publish_adapters/<model>`, the adapters it carried: drmas/broker/publishing.py);
- throughput: accepted episodes and response tokens per second over the last 30 s;
- where the time went since the previous line: the broker's busy fraction
  (`broker/busy`, drmas/broker/cpu.py) and the actors' shares (`actors/generating`,
  `actors/waiting_for_leases`, `actors/loading_weights`, from their heartbeats);
- the mean team reward and workflow metrics (`rollout/<name>`, e.g. search calls per
  episode) of the episodes accepted since the previous line.
Validation results get lines of their own with the step they evaluated.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Protocol

from drmas.broker.cpu import CpuBook
from drmas.protocol.messages import ACTOR_TIME_STATES, EpisodeHeader


class NullSink:
    def write(self, record: dict[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlSink:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: IO[str] = path.open("a", buffering=1)

    def write(self, record: dict[str, float]) -> None:
        self._f.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self._f.close()


class Sink(Protocol):
    """Where lines go: metrics.jsonl, and the trackers (drmas/broker/trackers.py)."""

    def write(self, record: dict[str, float]) -> None: ...

    def close(self) -> None: ...


class StepMetrics:
    """Merges per-model reports into one line per step."""

    def __init__(self, sink: Sink, models: list[str]) -> None:
        self.sink = sink
        self.parts = {(m, part) for m in models for part in ("step", "publish")}
        self.pending: dict[int, dict[str, float]] = {}
        self.reported: dict[int, set[tuple[str, str]]] = {}
        self.flushed: set[int] = set()
        self.started = time.monotonic()
        self.window_s = 30.0
        self._intake: collections.deque[tuple[float, int, int]] = collections.deque()
        self._episode_sums: dict[str, float] = collections.defaultdict(float)
        self._episode_counts: dict[str, int] = collections.defaultdict(int)
        self.cpu = CpuBook()  # the broker's CPU per message type (filled by the server)
        self._actor_now: dict[str, dict[str, float]] = {}  # actor -> its latest totals
        self._actor_line: dict[str, dict[str, float]] = {}  # ... as of the previous line

    def count_intake(self, episodes: int, tokens: int) -> None:
        self._intake.append((time.monotonic(), episodes, tokens))

    def count_episodes(self, episodes: Iterable[EpisodeHeader]) -> None:
        """Team reward and workflow metrics of accepted training episodes; each step line
        gets their means over the episodes accepted since the previous line
        (`rollout/reward`, `rollout/<name>`)."""
        sums, counts = self._episode_sums, self._episode_counts
        for episode in episodes:
            sums["reward"] += episode.reward
            counts["reward"] += 1
            for name, value in episode.metrics.items():
                sums[name] += value
                counts[name] += 1

    def actor_time(self, actor: str, totals: dict[str, float]) -> None:
        """An actor's heartbeat: its cumulative seconds per state."""
        self._actor_now[actor] = dict(totals)

    def forget_actor(self, actor: str) -> None:
        self._actor_now.pop(actor, None)
        self._actor_line.pop(actor, None)

    def _actor_fractions(self) -> dict[str, float]:
        """`actors/<state>`: the share of the connected actors' time since the previous
        line spent generating, waiting for leases and loading weights (heartbeats carry
        the totals, so a line lags by up to one heartbeat interval)."""
        spent = dict.fromkeys(ACTOR_TIME_STATES, 0.0)
        for actor, totals in self._actor_now.items():
            before = self._actor_line.get(actor, {})
            for state in ACTOR_TIME_STATES:
                spent[state] += max(0.0, totals.get(state, 0.0) - before.get(state, 0.0))
        self._actor_line = {a: dict(t) for a, t in self._actor_now.items()}
        total = sum(spent.values())
        return {f"actors/{s}": v / total for s, v in spent.items()} if total > 0 else {}

    def rates(self, now: float) -> tuple[float, float]:
        """Accepted episodes/s and response tokens/s over the last `window_s` seconds."""
        while self._intake and now - self._intake[0][0] > self.window_s:
            self._intake.popleft()
        span = max(min(self.window_s, now - self.started), 1e-9)
        return (
            sum(e for _, e, _ in self._intake) / span,
            sum(t for _, _, t in self._intake) / span,
        )

    def add(self, step: int, values: dict[str, float]) -> None:
        """Values for `step`'s line; dropped once that line is written (a re-publish of an
        old version, or a step from before a resume, must not write a second line)."""
        if step in self.flushed:
            return
        self.pending.setdefault(step, {}).update(values)

    def report(
        self, step: int, model: str, part: str, values: dict[str, float], counters: dict[str, int]
    ) -> None:
        """`part` is "step" (learner metrics) or "publish" (weight sync)."""
        if step in self.flushed:
            return
        self.add(step, values)
        self.reported.setdefault(step, set()).add((model, part))
        if self.reported[step] >= self.parts:
            self.flush(step, counters)

    def flush(self, step: int, counters: dict[str, int]) -> None:
        line = {"step": step, **self.pending.pop(step, {})}
        line["episodes_per_s"], line["tokens_per_s"] = self.rates(time.monotonic())
        line["dropped_stale_groups"] = counters.get("dropped_stale_groups", 0)
        line["zero_variance_groups_skipped"] = counters.get("zero_variance_groups_skipped", 0)
        line |= {k: v for k, v in counters.items() if k.startswith("zero_variance_slices_")}
        line["broker/busy"] = self.cpu.busy_since_last_line(time.monotonic())
        line |= self._actor_fractions()
        for name, total in self._episode_sums.items():
            line[f"rollout/{name}"] = total / self._episode_counts[name]
        self._episode_sums.clear()
        self._episode_counts.clear()
        line["time_s"] = time.time()
        self.reported.pop(step, None)
        self.flushed.add(step)
        self.sink.write(line)

    def write(self, record: dict[str, float]) -> None:
        self.sink.write({**record, "time_s": time.time()})

    def snapshot(self) -> dict[str, int]:
        """For the broker's checkpoint: the newest step whose line was written."""
        return {"metrics_step": max(self.flushed, default=0)}

    def restore(self, versions: dict[str, int]) -> None:
        """On resume with each model at `versions`: lines up to the lowest version stay (the
        later ones were moved to metrics.rewound.jsonl); a step between the lowest and a
        model's own version is written again once the models behind report it, and the
        models already past it count as reported (their re-publish on resume is not a new
        line either)."""
        step = min(versions.values())
        self.flushed.update(range(step + 1))
        for s in range(step + 1, max(versions.values()) + 1):
            self.reported[s] = {
                (m, part) for m, v in versions.items() if v >= s for part in ("step", "publish")
            }

    def close(self, counters: dict[str, int]) -> None:
        for step in sorted(self.pending):
            self.flush(step, counters)
        self.sink.close()
