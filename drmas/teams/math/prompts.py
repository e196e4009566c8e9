"""Prompts and action parsing of the math team (Solver <-> Verifier). Our own wording.

Each agent's prompt = role instruction + task + team context (earlier agents' outputs,
labelled by agent). `plain` style is plain text (what the tiny character-level model is
warm-started on); `chat` style wraps the same content in the tokenizer's chat template,
after a worked example of the agent's reply as earlier user/assistant turns (EXAMPLES).

Why the examples: a small instruct model told to "put the final answer in \\boxed{}"
answers in prose and never writes \\boxed{} or <verify> (SmolLM2-135M-Instruct: 0 of 64
parseable answers on two-digit sums). Shown one exchange in the reply format, its Solver
writes that format every time (64 of 64, greedy, operands 0..19) and its Verifier, shown
a rejection and an approval, about half the time (30 of 64), which is left for RL to
teach. An example inside the system message did not work for it (0 of 64). Larger models
follow the format either way; the examples cost them ~60-120 prompt tokens.

plain layout (responses start with a space and end with EOS):

    {instruction}
    Question: {question}
    Solver: \\boxed{17}
    Verifier: <verify>no</verify>
    Solver:
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from drmas.teams.layout import TeamLayout

SOLVER = "solver"
VERIFIER = "verifier"
LABELS = {SOLVER: "Solver", VERIFIER: "Verifier"}

INSTRUCTIONS = {
    SOLVER: (
        "You are the Solver. Solve the question. If a Verifier rejected an earlier answer, "
        "find the mistake. Put the final answer in \\boxed{}."
    ),
    VERIFIER: (
        "You are the Verifier. Check the Solver's latest answer. Reply <verify>yes</verify> "
        "if it is correct, otherwise <verify>no</verify>."
    ),
}
TINY_INSTRUCTIONS = {SOLVER: "Solve.", VERIFIER: "Check."}

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_VERIFY = re.compile(r"<verify>\s*(yes|no)\s*</verify>", re.IGNORECASE)


@dataclass(frozen=True)
class ChatExample:
    """One worked exchange shown before the real question: what the agent would be shown
    (question and team context) and the reply it should write."""

    question: str
    turns: tuple[tuple[str, str], ...]
    reply: str


EXAMPLES: dict[str, tuple[ChatExample, ...]] = {
    SOLVER: (ChatExample("3+4", (), "3+4 = 7. \\boxed{7}"),),
    VERIFIER: (
        ChatExample(
            "15-9", ((SOLVER, "15-9 = 5. \\boxed{5}"),), "15-9 = 6, not 5. <verify>no</verify>"
        ),
        ChatExample("3+4", ((SOLVER, "3+4 = 7. \\boxed{7}"),), "3+4 = 7. <verify>yes</verify>"),
    ),
}
"""The chat style's examples per agent (measured on SmolLM2-135M-Instruct, operands
0..19: one Solver example gave 0.45 greedy accuracy; adding a second one, a retry after a
rejection, lowered it to 0.31, so the Solver gets one. The Verifier gets a rejection and
an approval, in that order: it tends to repeat the last verdict it was shown, and with
the rejection last it rejected all 64 answers, right or wrong)."""


@dataclass(frozen=True)
class ExampleLayout(TeamLayout):
    """TeamLayout whose chat style puts each agent's worked examples between the system
    message and the real question, as earlier user/assistant turns in the same layout."""

    examples: Mapping[str, Sequence[ChatExample]] = field(default_factory=dict)

    def chat_messages(
        self, agent: str, question: str, turns: Sequence[tuple[str, str]], instruction: str
    ) -> list[dict[str, str]]:
        system, *rest = super().chat_messages(agent, question, turns, instruction)
        shots: list[dict[str, str]] = []
        for example in self.examples.get(agent, ()):
            shown = super().chat_messages(agent, example.question, example.turns, instruction)
            shots += [*shown[1:], {"role": "assistant", "content": example.reply}]
        return [system, *shots, *rest]


LAYOUT = ExampleLayout(LABELS, examples=EXAMPLES)
context_lines = LAYOUT.context_lines
plain_prompt = LAYOUT.plain_prompt
chat_messages = LAYOUT.chat_messages


def parse_boxed(text: str) -> str | None:
    """Last \\boxed{...} content, or None (an invalid Solver action)."""
    found = _BOXED.findall(text)
    return found[-1].strip() if found else None


def parse_verdict(text: str) -> bool | None:
    """True = approve, False = reject, None = no <verify> tag (invalid action; treated as a
    rejection, unlike the reference code which approved it)."""
    found = _VERIFY.findall(text)
    return found[-1].lower() == "yes" if found else None


def solver_response(answer: str) -> str:
    return f" \\boxed{{{answer}}}"


def verifier_response(approve: bool) -> str:
    return f" <verify>{'yes' if approve else 'no'}</verify>"
