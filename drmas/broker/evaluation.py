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

    def record(self, task: Task, rewards: list[float]) -> None:
        self.successes[task.task_id] = sum(r >= 1.0 for r in rewards)

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
        }
