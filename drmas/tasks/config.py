"""Task source settings (owned by the broker process). Plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TaskConfig:
    """Where prompts come from."""

    name: str = "arithmetic"
    """arithmetic: synthetic a+b; jsonl/parquet: local files with question and answer."""
    train_path: str = ""
    """jsonl/parquet: training file."""
    val_path: str = ""
    """jsonl/parquet: held-out file (empty = none)."""
    question_key: str = "question"
    """Column holding the question."""
    answer_key: str = "answer"
    """Column holding the gold answer."""
    max_operand: int = 19
    """arithmetic: operands drawn from 0..max_operand."""
    num_ops: int = 1
    """arithmetic: number of + / - operations."""
    num_train: int = 4096
    """arithmetic: training tasks (one epoch)."""
    num_val: int = 64
    """arithmetic: held-out tasks."""
    seed: int = 0
    """Shuffling and generation seed."""
