"""Warm-start transcripts for the built-in tiny model in program.py's own format, so RL
starts between reward 0 and 1 (a real pretrained model needs none of this: drop
`warmstart` from config.yaml and point `path` at it). Uses drmas's helpers; program.py
does not.

Each transcript is one agent call as the endpoint renders it for a model without a chat
template (drmas.teams.program.chat.plain_chat): the Solver right about 70 % of the time
(off by 1 to 3 otherwise), the Checker's verdict right 70 % of the time, and a retry
after a "No." right as often as a first answer.
"""

import random
from dataclasses import dataclass

from drmas.models.warmstart import TranscriptSource, generate
from drmas.teams.math.transcripts import ArithmeticSpec, arithmetic_question
from drmas.teams.program.chat import plain_chat

SOLVE, CHECK = "Solve.", "Check."


@dataclass(frozen=True)
class Spec:
    solver_right: float = 0.7
    checker_right: float = 0.7
    kinds: tuple[float, float, float] = (0.6, 0.3, 0.1)  # solver, checker, retry
    seed: int = 0


SPEC = Spec()
QUESTIONS = ArithmeticSpec()  # the arithmetic task source's questions, held-out ones excluded


def _answer(rng, gold, right):
    if rng.random() < right:
        return gold
    return str(int(gold) + rng.randint(1, 3) * rng.choice((-1, 1)))


def transcript(rng, kind):
    question, gold = arithmetic_question(rng, QUESTIONS)
    solver = [{"role": "system", "content": SOLVE}, {"role": "user", "content": question}]
    if kind == 0:
        return plain_chat(solver), " " + _answer(rng, gold, SPEC.solver_right)
    if kind == 1:
        shown = _answer(rng, gold, 0.5)
        truth = shown == gold
        verdict = truth if rng.random() < SPEC.checker_right else not truth
        messages = [
            {"role": "system", "content": CHECK},
            {"role": "user", "content": f"{question} = {shown}"},
        ]
        return plain_chat(messages), " yes" if verdict else " no"
    wrong = _answer(rng, gold, 0.0)
    retry = [*solver, {"role": "assistant", "content": wrong}, {"role": "user", "content": "No."}]
    return plain_chat(retry), " " + _answer(rng, gold, SPEC.solver_right)


def draw(rng, n, progress=0.0):
    kind = rng.choices(range(3), weights=SPEC.kinds)[0]
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
