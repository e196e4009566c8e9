"""Synthetic arithmetic tasks: `12+7`, `12+7-3`, ... with integer answers.

Questions are non-negative integer operands (uniform in 0..max_operand) joined by `+` or
`-` (each equally likely; `ops="+"` or `"-"` for one of them only), without spaces; the answer is the exact integer result as a string (it can be
negative). Everything is a pure function of the seed, so every process that builds the
set gets the same tasks.

The held-out set is drawn first, without repeats, from its own random stream; the
training set is drawn from another stream and rejects any question of the held-out set,
so no validation question is ever trained on. Training questions may repeat (with small
operands the question space is smaller than a training set).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from drmas.protocol.messages import Task

if TYPE_CHECKING:
    from drmas.config.task import TaskConfig


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str


OPS = ("+-", "+", "-")
"""The operator sets a question may use (`task.ops`)."""


def question_space(max_operand: int, num_ops: int, ops: str = "+-") -> int:
    """Number of distinct questions: operand choices times operator choices."""
    return (max_operand + 1) ** (num_ops + 1) * len(ops) ** num_ops


def draw(rng: random.Random, max_operand: int, num_ops: int, ops: str = "+-") -> Problem:
    """One random question; its answer evaluates left to right (+ and - only). With both
    operators the draws are those of every earlier version (the same seed, the same tasks)."""
    value = rng.randint(0, max_operand)
    text = [str(value)]
    for _ in range(num_ops):
        operand = rng.randint(0, max_operand)
        if ops == "+" or (ops == "+-" and rng.random() < 0.5):
            value += operand
            text.append(f"+{operand}")
        else:
            value -= operand
            text.append(f"-{operand}")
    return Problem("".join(text), str(value))


def generate(
    num_train: int, num_val: int, max_operand: int, num_ops: int, seed: int, ops: str = "+-"
) -> tuple[list[Problem], list[Problem]]:
    """(train, val): `num_val` distinct held-out problems and `num_train` training problems
    that never repeat a held-out question."""
    if max_operand < 0 or num_ops < 1:
        raise ValueError(
            f"arithmetic needs max_operand >= 0 and num_ops >= 1, got {max_operand}, {num_ops}"
        )
    if ops not in OPS:
        raise ValueError(f"task.ops={ops!r}: pick one of {', '.join(map(repr, OPS))}")
    if num_train < 0 or num_val < 0:
        raise ValueError(f"num_train and num_val must be >= 0, got {num_train}, {num_val}")
    space = question_space(max_operand, num_ops, ops)
    if num_train > 0 and num_val >= space:
        raise ValueError(
            f"num_val={num_val} held-out questions leave no training question: only {space} "
            f"distinct questions exist with max_operand={max_operand}, num_ops={num_ops}, "
            f"ops={ops!r}"
        )
    if num_val > space:
        raise ValueError(f"num_val={num_val} exceeds the {space} distinct questions")

    val_rng = random.Random(f"drmas.arithmetic:{seed}:val")
    val: list[Problem] = []
    held_out: set[str] = set()
    while len(val) < num_val:
        problem = draw(val_rng, max_operand, num_ops, ops)
        if problem.question not in held_out:
            held_out.add(problem.question)
            val.append(problem)

    train_rng = random.Random(f"drmas.arithmetic:{seed}:train")
    train: list[Problem] = []
    while len(train) < num_train:
        problem = draw(train_rng, max_operand, num_ops, ops)
        if problem.question not in held_out:
            train.append(problem)
    return train, val


def task_source(cfg: TaskConfig) -> tuple[list[Task], list[Task]]:
    """`task.name=arithmetic`: training and held-out tasks with ids `arithmetic:{split}:{i}`."""
    train, val = generate(
        cfg.num_train, cfg.num_val, cfg.max_operand, cfg.num_ops, cfg.seed, cfg.ops
    )
    return _tasks(train, "train"), _tasks(val, "val")


def _tasks(problems: list[Problem], split: str) -> list[Task]:
    return [
        Task(f"arithmetic:{split}:{i}", p.question, p.answer, "arithmetic")
        for i, p in enumerate(problems)
    ]
