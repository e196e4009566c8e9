"""Prompts and action parsing of the math team (Solver <-> Verifier). Our own wording.

Each agent's prompt = role instruction + task + team context (earlier agents' outputs,
labelled by agent). `plain` style is plain text (what the tiny character-level model is
warm-started on); `chat` style wraps the same content in the tokenizer's chat template.

plain layout (responses start with a space and end with EOS):

    {instruction}
    Question: {question}
    Solver: \\boxed{17}
    Verifier: <verify>no</verify>
    Solver:
"""

from __future__ import annotations

import re

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


LAYOUT = TeamLayout(LABELS)
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
