"""Grading a final answer against the gold answer: the team reward of a math episode.

Plain numbers (integers, decimals, simple fractions such as `-3/4`) are compared exactly
as rationals without touching sympy, which covers the synthetic arithmetic tasks and most
math answers at microsecond cost. Everything else goes through math_verify (LaTeX and
symbolic equivalence). math_verify bounds its work with SIGALRM, which only exists in the
main thread; elsewhere we cannot bound a sympy call, so we fall back to comparing the
normalised strings rather than risk a hang. `grade` never raises on malformed input.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 512
"""Longer answers are compared as strings only (sympy on huge input is slow)."""
TIMEOUT_S = 5
"""math_verify's parsing and comparison timeout (whole seconds; SIGALRM)."""

_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_FRACTION = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_WRAPPERS = re.compile(r"^\$+|\$+$")


def grade(response_answer: str | None, gold: str) -> bool:
    """True iff the extracted answer (content of the last `\\boxed{}`, or None) equals gold."""
    if response_answer is None:
        return False
    try:
        answer, reference = _normalise(response_answer), _normalise(gold)
        if not answer or not reference:
            return False
        a, g = as_number(answer), as_number(reference)
        if a is not None and g is not None:
            return a == g
        if answer == reference:
            return True
        if (
            len(answer) > MAX_ANSWER_CHARS
            or len(reference) > MAX_ANSWER_CHARS
            or threading.current_thread() is not threading.main_thread()
        ):
            return False
        return _math_verify(answer, reference)
    except Exception:  # malformed input must never take an episode down
        logger.debug("grading %r against %r failed", response_answer, gold, exc_info=True)
        return False


def as_number(text: str) -> Fraction | None:
    """Exact value of an integer, decimal or `p/q` string; None for anything else."""
    text = text.replace(" ", "")
    if _NUMBER.fullmatch(text):
        return Fraction(text)
    match = _FRACTION.fullmatch(text)
    if match and int(match.group(2)) != 0:
        return Fraction(int(match.group(1)), int(match.group(2)))
    return None


def _normalise(text: str) -> str:
    return _WRAPPERS.sub("", text.strip()).strip()


def _math_verify(answer: str, gold: str) -> bool:
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = _parse(parse, gold)
        answer_parsed = _parse(parse, answer)
        if not gold_parsed or not answer_parsed:
            return False
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=TIMEOUT_S))
    except TimeoutException:  # a BaseException in math_verify; normally caught inside it
        return False


def _parse(parse: Callable[..., list[Any]], text: str) -> list[Any]:
    """Parse as a boxed answer (the most reliable extraction), else as inline math."""
    for wrapped in (f"\\boxed{{{text}}}", f"${text}$"):
        parsed = parse(wrapped, parsing_timeout=TIMEOUT_S)
        if parsed:
            return list(parsed)
    return []
