"""Validation rounds: held-out tasks leased to actors (is_eval), scored as avg@k / pass@k.

`Validation` is the broker's book of them (owned by BrokerState, drmas/broker/state.py):
which steps have a round, the rounds still open and the queue of groups not yet leased.
`EvalRound` is one round; `drmas evaluate` (drmas/launch/evaluate.py) scores with it too.
Both snapshot to and restore from the broker's checkpoint (drmas/broker/checkpoint.py).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from math import comb, sqrt
from typing import TYPE_CHECKING, Any

from drmas.protocol.messages import EpisodeHeader, Task

if TYPE_CHECKING:
    from drmas.config import DrmasConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c successes: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalRound:
    """One evaluation at `step`: every task sampled n times."""

    step: int
    tasks: list[Task]
    n: int
    k: int
    successes: dict[str, int] = field(default_factory=dict)  # task_id -> successes of n
    sums: dict[str, float] = field(default_factory=dict)  # workflow metric -> sum
    counts: dict[str, int] = field(default_factory=dict)  # workflow metric -> episodes
    # workflow metric -> per-task means (for the standard error over tasks)
    task_means: dict[str, list[float]] = field(default_factory=dict)

    def record(
        self, task: Task, rewards: list[float], metrics: list[dict[str, float]] | None = None
    ) -> None:
        """The n episodes of one task: rewards (success = reward >= 1) and, per episode, the
        workflow's metrics (averaged into val/<name>). A task recorded twice (a re-issued
        lease that finished twice) keeps its first result."""
        if task.task_id in self.successes:
            return
        self.successes[task.task_id] = sum(r >= 1.0 for r in rewards)
        mine: dict[str, list[float]] = {}
        for episode in metrics or []:
            for name, value in episode.items():
                self.sums[name] = self.sums.get(name, 0.0) + value
                self.counts[name] = self.counts.get(name, 0) + 1
                mine.setdefault(name, []).append(value)
        for name, values in mine.items():
            self.task_means.setdefault(name, []).append(sum(values) / len(values))

    @property
    def complete(self) -> bool:
        return len(self.successes) == len(self.tasks)

    def snapshot(self) -> dict[str, Any]:
        """What a checkpoint keeps: the tasks (by id) and the successes recorded so far."""
        return {"task_ids": [t.task_id for t in self.tasks], "successes": self.successes}

    @classmethod
    def restore(
        cls, step: int, saved: Mapping[str, Any], tasks: Mapping[str, Task], n: int, k: int
    ) -> EvalRound:
        """A round from its `snapshot`; `tasks` maps task ids to the run's validation tasks."""
        rnd = cls(step, [tasks[t] for t in saved["task_ids"]], n, k)
        rnd.successes = {t: int(c) for t, c in saved["successes"].items()}
        return rnd

    def metrics(self) -> dict[str, float]:
        """Means over tasks, each with `<key>/se`: its standard error over the tasks (sample
        std / sqrt(tasks); the n samples of one task are not independent, the tasks are)."""
        counts = list(self.successes.values())
        per_task = {
            f"val/avg@{self.k}": [c / self.n for c in counts],
            f"val/pass@{self.k}": [pass_at_k(self.n, c, self.k) for c in counts],
            "val/pass@1": [pass_at_k(self.n, c, 1) for c in counts],
        }
        out = {"val/tasks": float(len(counts))}
        for key, values in per_task.items():
            out[key] = sum(values) / len(values)
            out[f"{key}/se"] = standard_error(values)
        for name, total in self.sums.items():
            out[f"val/{name}"] = total / self.counts[name]
            out[f"val/{name}/se"] = standard_error(self.task_means.get(name, []))
        return out | self._per_source()

    def _per_source(self) -> dict[str, float]:
        """With tasks from two or more data sources (MATH500, AIME24, ...; NQ, HotpotQA,
        ...): val/<source>/{avg@k,pass@k,tasks} and their standard errors, as the papers
        report them (the averages over all tasks above weigh sources by their size)."""
        source_of = {t.task_id: t.source or "default" for t in self.tasks}
        by_source: dict[str, list[int]] = {}
        for task_id, c in self.successes.items():
            by_source.setdefault(source_of.get(task_id, "default"), []).append(c)
        if len(by_source) < 2:
            return {}
        out: dict[str, float] = {}
        for source, counts in sorted(by_source.items()):
            per_task = {
                f"avg@{self.k}": [c / self.n for c in counts],
                f"pass@{self.k}": [pass_at_k(self.n, c, self.k) for c in counts],
            }
            out[f"val/{source}/tasks"] = float(len(counts))
            for key, values in per_task.items():
                out[f"val/{source}/{key}"] = sum(values) / len(values)
                out[f"val/{source}/{key}/se"] = standard_error(values)
        return out


class Validation:
    """The run's validation rounds: a round every `val.every` steps (and at step 0 unless
    `val.at_start` is off, and at train.steps), opened once the models' lowest version
    reaches its step. Its groups wait in `queue` as (task, step) and are leased before
    training groups; a round's metrics line is written when its last task comes back."""

    def __init__(self, cfg: DrmasConfig) -> None:
        self.val = cfg.val
        self.steps = cfg.train.steps
        self.queue: collections.deque[tuple[Task, int]] = collections.deque()
        self.rounds: dict[int, EvalRound] = {}  # step -> its open round
        self.scheduled: set[int] = set()  # steps that have (had) a round

    def schedule(self, step: int, val_tasks: Callable[[int], list[Task]]) -> None:
        """Open every round due by `step` (the models' lowest version) not opened yet."""
        every = self.val.every
        if not every:
            return
        first = 0 if self.val.at_start else every
        due = [*range(first, step + 1, every), *([self.steps] if step >= self.steps else [])]
        for s in due:
            if s not in self.scheduled:
                self.scheduled.add(s)
                tasks = val_tasks(self.val.num_tasks)
                self.rounds[s] = EvalRound(s, tasks, self.val.n, self.val.k)
                self.queue.extend((t, s) for t in tasks)

    def record(
        self, step: int, task: Task, episodes: Sequence[EpisodeHeader]
    ) -> dict[str, float] | None:
        """One task's group for the round at `step`; returns the round's metrics line once
        its last task is in (the round is then closed)."""
        rnd = self.rounds.get(step)
        if rnd is None:
            return None
        rnd.record(task, [e.reward for e in episodes], [e.metrics for e in episodes])
        if not rnd.complete:
            return None
        del self.rounds[step]
        return {"step": step, **rnd.metrics()}

    def requeue(self, task: Task, step: int) -> None:
        """A leased group that did not come back: first in line again."""
        self.queue.appendleft((task, step))

    @property
    def pending(self) -> bool:
        """A round is open, or the final one (at train.steps) is still to come."""
        return bool(self.rounds) or (self.val.every > 0 and self.steps not in self.scheduled)

    def snapshot(self) -> dict[str, Any]:
        return {
            "scheduled": sorted(self.scheduled),
            "rounds": {str(s): r.snapshot() for s, r in self.rounds.items()},
        }

    def restore(self, saved: Mapping[str, Any], step: int, val_tasks: list[Task]) -> None:
        """Rounds up to `step` (the lowest resumed version) as saved, their unfinished tasks
        queued again; rounds of later steps are forgotten, to be redone."""
        by_id = {t.task_id: t for t in val_tasks}
        self.scheduled = {s for s in saved["scheduled"] if s <= step}
        self.rounds.clear()
        self.queue.clear()
        for key, kept in sorted(saved["rounds"].items(), key=lambda kv: int(kv[0])):
            if int(key) <= step:
                rnd = EvalRound.restore(int(key), kept, by_id, self.val.n, self.val.k)
                self.rounds[rnd.step] = rnd
                self.queue.extend(
                    (t, rnd.step) for t in rnd.tasks if t.task_id not in rnd.successes
                )


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of independent values; 0 for fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
