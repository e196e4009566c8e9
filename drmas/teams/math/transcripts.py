"""Math-team warm-start transcripts: generated arithmetic in the plain tiny format.

An untrained model never writes a parseable `\\boxed{}` answer, so RL would see reward 0
everywhere; these transcripts teach the Solver/Verifier format until the Solver is right
about half the time (or more: tiny_math.yaml says what the default reaches).
"""

from __future__ import annotations

import functools
import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from drmas.models.warmstart import Pairs, TranscriptSource, generate
from drmas.teams.math import arithmetic
from drmas.teams.math.prompts import (
    SOLVER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    parse_boxed,
    plain_prompt,
    solver_response,
    verifier_response,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("drmas.models")


@dataclass(frozen=True)
class ArithmeticSpec:
    """Questions of the warm start; matches the arithmetic task source's defaults."""

    max_operand: int = 19
    """Operands drawn from 0..max_operand."""
    ops: str = "+-"
    """Operations to draw from (one per question)."""
    max_wrong_offset: int = 3
    """A wrong Solver answer is off by 1..max_wrong_offset."""
    verifier_label_noise: float = 0.2
    """Fraction of Verifier transcripts whose verdict is flipped (an imperfect verifier)."""
    verifier_correct_frac: float = 0.6
    """Fraction of Verifier transcripts whose Solver answer is right. A balanced mix left
    the tiny Verifier at chance but nearly always saying "no" (entropy ~0.06), so correct
    first answers were thrown away and RL had no verdict to explore. With label noise 0.2
    the transcripts say "yes" 56 % of the time: the warm-started Verifier leans to
    approval but rejects often, which the team must learn to stop. At 0.7 (62 % "yes")
    the team started higher (held-out avg@2 0.71-0.73) and gained +0.09 to +0.14 in 30
    steps; at 0.6 it starts at 0.50-0.56 and gains about +0.2 (tiny_math.yaml)."""
    kind_weights: tuple[float, float, float] = (0.9, 0.05, 0.05)
    """Mix of transcript kinds: Solver first turn, Verifier, Solver after a rejection. The
    two later kinds are 2-3x longer; a few percent teaches their format, and more of them
    (within the same build time) costs Solver accuracy without making the tiny Verifier
    judge better than chance: RL is left to improve it."""
    held_out: int = 256
    """The first this many held-out questions of the arithmetic task source at task.seed
    0 (one op, these operands) never appear in the warm start either: drmas validates on
    questions that were never trained on, not even here. Up to task.num_val=256 at seed 0
    the validation set is exactly (a prefix of) these."""
    seed: int = 0
    """Data and initialisation seed."""


ARITHMETIC = ArithmeticSpec()


@functools.lru_cache(maxsize=4)
def held_out_questions(max_operand: int, count: int) -> frozenset[str]:
    _, val = arithmetic.generate(0, count, max_operand, 1, seed=0)
    return frozenset(p.question for p in val)


def arithmetic_question(rng: random.Random, spec: ArithmeticSpec) -> tuple[str, str]:
    """(question, gold answer) written as the arithmetic task source writes them: `12+7`;
    never one of the held-out validation questions."""
    held_out = held_out_questions(spec.max_operand, spec.held_out)
    while True:
        a = rng.randint(0, spec.max_operand)
        b = rng.randint(0, spec.max_operand)
        op = rng.choice(spec.ops)
        if f"{a}{op}{b}" not in held_out:
            return f"{a}{op}{b}", str(a + b if op == "+" else a - b)


def _wrong(rng: random.Random, gold: str, spec: ArithmeticSpec) -> str:
    offset = rng.randint(1, spec.max_wrong_offset) * rng.choice((-1, 1))
    return str(int(gold) + offset)


def transcript(rng: random.Random, spec: ArithmeticSpec, kind: int) -> tuple[str, str]:
    """(prompt, response) of one agent call in the plain tiny-instruction format; kind 0:
    Solver first turn, 1: Verifier, 2: Solver after a rejection."""
    question, gold = arithmetic_question(rng, spec)
    if kind == 0:  # Solver, first turn
        return plain_prompt(SOLVER, question, [], TINY_INSTRUCTIONS[SOLVER]), solver_response(gold)
    if kind == 1:  # Verifier judging one Solver answer (half right), with label noise
        correct = rng.random() < spec.verifier_correct_frac
        answer = gold if correct else _wrong(rng, gold, spec)
        verdict = correct != (rng.random() < spec.verifier_label_noise)
        turns = [(SOLVER, solver_response(answer))]
        prompt = plain_prompt(VERIFIER, question, turns, TINY_INSTRUCTIONS[VERIFIER])
        return prompt, verifier_response(verdict)
    # Solver after the Verifier rejected a wrong answer
    turns = [
        (SOLVER, solver_response(_wrong(rng, gold, spec))),
        (VERIFIER, verifier_response(False)),
    ]
    return plain_prompt(SOLVER, question, turns, TINY_INSTRUCTIONS[SOLVER]), solver_response(gold)


def draw(
    rng: random.Random, n: int, progress: float = 0.0, spec: ArithmeticSpec = ARITHMETIC
) -> Pairs:
    """A batch of one transcript kind (the mix does not change with `progress`)."""
    """One kind per batch: the kinds differ in length by 2x, so mixing them would mostly
    pay for padding."""
    kind = rng.choices(range(3), weights=spec.kind_weights)[0]
    return [transcript(rng, spec, kind) for _ in range(n)]


def report(
    model: Any, tokenizer: PreTrainedTokenizerBase, spec: ArithmeticSpec = ARITHMETIC
) -> None:
    eval_rng = random.Random(spec.seed + 1)
    questions = [arithmetic_question(eval_rng, spec) for _ in range(128)]
    greedy = solver_accuracy(model, tokenizer, questions, temperature=0.0)
    sampled = solver_accuracy(model, tokenizer, questions, temperature=1.0)
    log.info("warm start done: solver accuracy greedy %.2f, temperature 1 %.2f", greedy, sampled)


def solver_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    questions: list[tuple[str, str]],
    temperature: float,
    seed: int = 0,
    max_new_tokens: int = 16,
) -> float:
    """Fraction of first-turn Solver answers whose `\\boxed{}` equals the gold answer."""
    prompts = [plain_prompt(SOLVER, q, [], TINY_INSTRUCTIONS[SOLVER]) for q, _ in questions]
    texts = generate(model, tokenizer, prompts, temperature, seed, max_new_tokens)
    right = sum(parse_boxed(text) == gold for text, (_, gold) in zip(texts, questions))
    return right / len(questions)


SOURCE = TranscriptSource(
    seed=ARITHMETIC.seed,
    spec=ARITHMETIC,
    instructions=TINY_INSTRUCTIONS,
    draw=draw,
    report=report,
)
