"""Live progress of `drmas train`, read from the run's metrics.jsonl (what the broker writes)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import IO, Any


class MetricsTail:
    """Reads new complete lines of metrics.jsonl as they appear."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: IO[str] | None = None
        self._partial = ""
        self.lines: list[dict[str, Any]] = []

    def poll(self) -> list[dict[str, Any]]:
        if self._f is None:
            if not self.path.exists():
                return []
            self._f = self.path.open()
        chunk = self._partial + self._f.read()
        *complete, self._partial = chunk.split("\n")
        new = [json.loads(line) for line in complete if line.strip()]
        self.lines.extend(new)
        return new

    def close(self) -> None:
        if self._f:
            self._f.close()


def _fmt(line: dict[str, Any], agents: list[str], steps: int) -> str:
    parts = [f"step {line['step']:>4}/{steps}"]
    if "val/tasks" in line:
        keys = sorted(
            k for k in line if k.startswith("val/") and k != "val/tasks" and not k.endswith("/se")
        )
        values = [
            f"{k}={line[k]:.3f}" + (f"±{line[k + '/se']:.3f}" if k + "/se" in line else "")
            for k in keys
        ]
        return parts[0] + f"  validation ({line['val/tasks']:.0f} tasks, ±SE)  " + "  ".join(values)
    for agent in agents:
        if f"reward/{agent}/mean" in line:
            parts.append(f"{agent} reward {line[f'reward/{agent}/mean']:.3f}")
    shown = {"em": "EM", "search_calls": "searches", "turns": "turns"}
    for key, label in shown.items():
        if f"rollout/{key}" in line:
            parts.append(f"{label} {line[f'rollout/{key}']:.2f}")
    grads = [
        f"{k.split('/', 1)[1]}={v:.2f}"
        for k, v in sorted(line.items())
        if k.startswith("grad_norm/")
    ]
    if grads:
        parts.append("grad " + " ".join(grads))
    parts.append(f"{line.get('episodes_per_s', 0.0):.1f} ep/s")
    parts.append(f"stale {line.get('staleness/mean', 0.0):.2f}")
    return "  ".join(parts)


class Progress:
    """One printed line per step (works in CI logs and terminals alike)."""

    def __init__(self, run_dir: Path, agents: list[str], steps: int, enabled: bool = True) -> None:
        self.tail = MetricsTail(run_dir / "metrics.jsonl")
        self.agents = agents
        self.steps = steps
        self.enabled = enabled
        self.started = time.monotonic()

    def update(self) -> None:
        for line in self.tail.poll():
            if self.enabled:
                elapsed = time.monotonic() - self.started
                print(
                    f"[{elapsed:6.0f}s] {_fmt(line, self.agents, self.steps)}",
                    file=sys.stdout,
                    flush=True,
                )

    def close(self) -> None:
        self.update()
        self.tail.close()
