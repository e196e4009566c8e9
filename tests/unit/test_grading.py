"""Answer grading: exact numbers fast, LaTeX through math_verify, never an exception."""

from __future__ import annotations

import threading

import pytest

from drmas.teams.math.grading import as_number, grade


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("17", "17", True),
        (" 17 ", "17", True),
        ("017", "17", True),
        ("18", "17", False),
        ("-9", "-9", True),
        ("9", "-9", False),
        ("+3", "3", True),
        ("- 5", "-5", True),
        ("3/4", "3/4", True),
        ("6/8", "3/4", True),
        ("0.75", "3/4", True),
        ("-1/2", "-0.5", True),
        ("0.5", "0.50", True),
        ("2.0", "2", True),
        ("1/3", "0.3333", False),
        ("$5$", "5", True),
    ],
)
def test_numbers(answer: str, gold: str, expected: bool) -> None:
    assert grade(answer, gold) is expected


@pytest.mark.parametrize(
    ("answer", "gold", "expected"),
    [
        ("\\frac{3}{4}", "0.75", True),
        ("\\dfrac{1}{2}", "1/2", True),
        ("\\sqrt{2}", "2^{1/2}", True),
        ("x+1", "1+x", True),
        ("\\pi", "\\pi", True),
        ("2\\pi", "\\pi", False),
        ("[0,1]", "[0, 1]", True),
        ("\\frac{1}{3}", "\\frac{2}{3}", False),
    ],
)
def test_latex(answer: str, gold: str, expected: bool) -> None:
    assert grade(answer, gold) is expected


@pytest.mark.parametrize(
    "answer",
    [None, "", "   ", "}{", "\\boxed{", "\\frac{", "$$", "1/0", "\x00\xff", "a" * 5000, "((((((("],
)
def test_garbage_and_none_are_false(answer: str | None) -> None:
    assert grade(answer, "1") is False


@pytest.mark.parametrize("gold", ["", "}{", "\\frac{", "1/0"])
def test_malformed_gold_is_false(gold: str) -> None:
    assert grade("1", gold) is False


def test_as_number() -> None:
    assert as_number("12") == 12
    assert as_number("-3/6") == as_number("-0.5")
    assert as_number("1/0") is None
    assert as_number("1e5") is None
    assert as_number("x") is None


def test_non_main_thread_does_not_raise() -> None:
    results: dict[str, bool] = {}

    def work() -> None:
        results["int"] = grade("12", "12")
        results["latex_equal_string"] = grade("\\frac{1}{2}", "\\frac{1}{2}")
        results["latex"] = grade("\\frac{1}{2}", "0.5")  # needs sympy: no timeout here -> False

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(30)
    assert results == {"int": True, "latex_equal_string": True, "latex": False}
