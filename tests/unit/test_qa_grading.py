"""Answer normalisation, EM and F1 against hand-made cases, and the search team's action
parsers on well-formed and malformed outputs."""

from __future__ import annotations

import pytest

from drmas.teams.search.prompts import (
    MAX_QUERY_CHARS,
    parse_answer,
    parse_search,
    parse_verdict,
    render_passages,
)
from drmas.teams.search.qa import exact_match, f1_score, normalize_answer


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  An   apple, a day!  ", "apple day"),
        ("U.S.A.", "usa"),
        ("Theory of the Atom", "theory of atom"),  # "The" inside "Theory" is not an article
        ("anthem", "anthem"),
        ("", ""),
        ("a an the", ""),
        ("Rock\n'n' roll", "rock n roll"),
    ],
)
def test_normalize_answer(raw: str, normalised: str) -> None:
    assert normalize_answer(raw) == normalised


def test_exact_match_takes_any_gold_answer() -> None:
    golds = ["Barack Obama", "Obama"]
    assert exact_match("obama.", golds) == 1.0
    assert exact_match("The Barack  Obama", golds) == 1.0
    assert exact_match("Michelle Obama", golds) == 0.0
    assert exact_match(None, golds) == 0.0
    assert exact_match("", ["x"]) == 0.0


def test_f1_is_the_best_token_overlap() -> None:
    assert f1_score("Barack Obama", ["Obama"]) == pytest.approx(2 / 3)  # p 1/2, r 1
    assert f1_score("president Barack Obama", ["Barack Obama", "x"]) == pytest.approx(0.8)
    assert f1_score("blue whale", ["whale shark"]) == pytest.approx(0.5)
    assert f1_score("red", ["blue"]) == 0.0
    assert f1_score(None, ["blue"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to nothing: identical
    assert f1_score("the", ["blue"]) == 0.0
    # repeated tokens count only as often as the gold has them
    assert f1_score("new new york", ["new york"]) == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("text", "verdict"),
    [
        (" <verify>yes</verify>", True),
        ("<verify> NO </verify>", False),
        ("<verify>no</verify> then <verify>yes</verify>", True),  # the last one counts
        ("yes", None),
        ("<verify>yes", None),  # unclosed
        ("<verify>maybe</verify>", None),
        ("", None),
    ],
)
def test_parse_verdict(text: str, verdict: bool | None) -> None:
    assert parse_verdict(text) is verdict


@pytest.mark.parametrize(
    ("text", "query"),
    [
        (" <search>Bo Taki</search>", "Bo Taki"),
        ("<search>\n  who   founded\tX </search>", "who founded X"),
        ("<search>a</search> <search>b</search>", "b"),
        ("<search></search>", None),
        ("<search>   </search>", None),
        ("<search>Bo Taki", None),  # unclosed
        ("Bo Taki</search>", None),
        ("search: Bo Taki", None),
        (f"<search>{'x' * (MAX_QUERY_CHARS + 1)}</search>", None),
        (f"<search>{'x' * MAX_QUERY_CHARS}</search>", "x" * MAX_QUERY_CHARS),
    ],
)
def test_parse_search(text: str, query: str | None) -> None:
    assert parse_search(text) == query


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        (" <answer>Lumo</answer>", "Lumo"),
        ("<answer> New  York </answer>", "New York"),
        ("<answer>a</answer><answer>b</answer>", "b"),
        ("<answer></answer>", None),
        ("<answer>Lumo", None),
        ("Lumo", None),
        ("<Answer>Lumo</Answer>", None),  # tags are lower case
    ],
)
def test_parse_answer(text: str, answer: str | None) -> None:
    assert parse_answer(text) == answer


class _Doc:
    def __init__(self, title: str, text: str) -> None:
        self.title, self.text = title, text


def test_render_passages_plain_and_chat() -> None:
    docs = [_Doc("Lumo", "Lumo is a city\nin Orsa."), _Doc("Bo Taki", "Bo Taki is a baker.")]
    assert render_passages(docs, "plain") == "Lumo is a city in Orsa. | Bo Taki is a baker."
    assert render_passages(docs, "chat") == (
        "[1] (Lumo) Lumo is a city in Orsa. [2] (Bo Taki) Bo Taki is a baker."
    )
    assert render_passages([], "plain") == "(no results)"
