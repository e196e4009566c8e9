"""Warm-start transcripts for the built-in tiny model in program.py's own format, so RL
starts between reward 0 and 1 (a real pretrained model needs none of this: drop
`warmstart` from config.yaml and point `path` at it). Uses drmas's helpers; program.py
does not.

Each transcript is one agent call as the endpoint renders it for a model without a chat
template (drmas.teams.program.chat.plain_chat): most are the Solver answering right (the
tiny model's own mistakes supply the wrong answers RL needs), the rest the Checker judging
an answer that is right half the time, its verdict right 80 % of the time.
"""

import random
from dataclasses import dataclass

from drmas.models.warmstart import TranscriptSource, generate
from drmas.teams.math.transcripts import ArithmeticSpec, arithmetic_question
from drmas.teams.program.chat import plain_chat

SOLVE, CHECK = "Solve.", "Check."


@dataclass(frozen=True)
class Spec:
    checker_right: float = 0.8
    kinds: tuple[float, float] = (0.85, 0.15)  # solver, checker
    seed: int = 0


SPEC = Spec()
QUESTIONS = ArithmeticSpec()  # the arithmetic task source's questions, held-out ones excluded


def _wrong(rng, gold):
    return str(int(gold) + rng.randint(1, 3) * rng.choice((-1, 1)))


def transcript(rng, kind):
    question, gold = arithmetic_question(rng, QUESTIONS)
    if kind == 0:
        solver = [{"role": "system", "content": SOLVE}, {"role": "user", "content": question}]
        return plain_chat(solver), " " + gold
    shown = gold if rng.random() < 0.5 else _wrong(rng, gold)
    truth = shown == gold
    verdict = truth if rng.random() < SPEC.checker_right else not truth
    messages = [
        {"role": "system", "content": CHECK},
        {"role": "user", "content": f"{question} = {shown}"},
    ]
    return plain_chat(messages), " yes" if verdict else " no"


def draw(rng, n, progress=0.0):
    kind = rng.choices(range(2), weights=SPEC.kinds)[0]
    return [transcript(rng, kind) for _ in range(n)]


def report(model, tokenizer):
    """The warm-started Solver's accuracy on 64 fresh questions (temperature 1)."""
    rng = random.Random(SPEC.seed + 1)
    questions = [arithmetic_question(rng, QUESTIONS) for _ in range(64)]
    prompts = [
        plain_chat([{"role": "system", "content": SOLVE}, {"role": "user", "content": q}])
        for q, _ in questions
    ]
    texts = generate(model, tokenizer, prompts, 1.0, 0, 6)
    right = sum(t.strip() == gold for t, (_, gold) in zip(texts, questions))
    print(f"warm start done: the Solver answers {right / len(questions):.2f} of 64 questions right")


SOURCE = TranscriptSource(
    seed=SPEC.seed,
    spec=SPEC,
    instructions={"solver": SOLVE, "checker": CHECK},
    draw=draw,
    report=report,
)
