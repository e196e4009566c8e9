"""Task source settings (owned by the broker process). Plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from drmas.config.types import NonNegative, Positive


@dataclass
class TaskConfig:
    """Where prompts come from."""

    name: str = "arithmetic"
    """arithmetic: synthetic a+b; kb: synthetic knowledge-base questions (search team);
    jsonl/parquet: local files with question and answer(s); or your own task source, a
    function (TaskConfig) -> (train, val) given as package.module:fn or path/to/file.py:fn."""
    train_path: str = ""
    """jsonl/parquet: training file."""
    val_path: str = ""
    """jsonl/parquet: held-out file (empty = none)."""
    question_key: str = "question"
    """Column holding the question."""
    answer_key: str = "answer"
    """Column holding the gold answer."""
    max_operand: NonNegative = 19
    """arithmetic: operands drawn from 0..max_operand."""
    num_ops: Positive = 1
    """arithmetic: number of + / - operations."""
    ops: Literal["+-", "+", "-"] = "+-"
    """arithmetic: the operators questions use ("+" alone: addition only). SmolLM2-135M adds
    single digits right 4 times in 5 and subtracts them right almost never, so "+" is how
    to give it a task it solves about half the time (docs/results.md)."""
    num_train: Positive = 4096
    """arithmetic: training tasks (one epoch)."""
    num_val: NonNegative = 64
    """arithmetic: held-out tasks."""
    kb_num_people: Positive = 200
    """kb: fictional people in the generated knowledge base (3 questions each)."""
    seed: int = 0
    """Generation and shuffling seed: which tasks exist, the held-out split, their order."""
    order_seed: int | None = None
    """Seed of the training order alone (None: `seed`). Varies the task stream while the
    tasks and the held-out split stay those of `seed`: the built-in warm starts leave out
    the held-out questions of seed 0, so a seed study varies this one, not `seed`."""
    options: dict[str, Any] = field(default_factory=dict)
    """Free settings of your own task source (read as cfg.options)."""
