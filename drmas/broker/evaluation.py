"""Validation rounds: held-out tasks leased to actors (is_eval), scored as avg@k / pass@k."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from math import comb, sqrt

from drmas.protocol.messages import Task


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


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean of independent values; 0 for fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
