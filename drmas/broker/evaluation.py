"""Validation rounds: held-out tasks leased to actors (is_eval), scored as avg@k / pass@k."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb

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

    def record(
        self, task: Task, rewards: list[float], metrics: list[dict[str, float]] | None = None
    ) -> None:
        """The n episodes of one task: rewards (success = reward >= 1) and, per episode, the
        workflow's metrics (averaged into val/<name>). A task recorded twice (a re-issued
        lease that finished twice) keeps its first result."""
        if task.task_id in self.successes:
            return
        self.successes[task.task_id] = sum(r >= 1.0 for r in rewards)
        for episode in metrics or []:
            for name, value in episode.items():
                self.sums[name] = self.sums.get(name, 0.0) + value
                self.counts[name] = self.counts.get(name, 0) + 1

    @property
    def complete(self) -> bool:
        return len(self.successes) == len(self.tasks)

    def metrics(self) -> dict[str, float]:
        counts = list(self.successes.values())
        return {
            f"val/avg@{self.k}": sum(c / self.n for c in counts) / len(counts),
            f"val/pass@{self.k}": sum(pass_at_k(self.n, c, self.k) for c in counts) / len(counts),
            "val/pass@1": sum(pass_at_k(self.n, c, 1) for c in counts) / len(counts),
            "val/tasks": float(len(counts)),
            **{f"val/{name}": total / self.counts[name] for name, total in self.sums.items()},
        }
