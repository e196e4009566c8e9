"""Prompts and action parsing of the search team (Verifier, Search Agent, Answer Agent).
Our own wording.

Each agent's prompt = role instruction + task + team context (earlier agents' outputs and
the retrieved passages, labelled). `plain` style is plain text (what the tiny
models are warm-started on); `chat` style wraps the same content in the tokenizer's chat
template. Passages are rendered by text only in plain style (the tiny model has 512
positions) and as `[1] (Title) text` in chat style.

plain layout (responses start with a space and end with EOS):

    {instruction}
    Question: In which country was Bo Taki born?
    Verifier: <verify>no</verify>
    Search: <search> Bo Taki</search>
    Info: Bo Taki was born in Lumo. | Bo Taki works as a baker.
    Verifier: <verify>no</verify>
    Search:
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Protocol

from drmas.teams.layout import TeamLayout

VERIFIER = "verifier"
SEARCHER = "searcher"
ANSWERER = "answerer"
INFO = "info"
"""Team-context entries that are retrieved passages, not an agent's output."""
SEARCH_TOOL = "search"
"""The team's tool (the retriever); its results join the team context as INFO entries."""
AGENTS = (VERIFIER, SEARCHER, ANSWERER)
LABELS = {VERIFIER: "Verifier", SEARCHER: "Search", ANSWERER: "Answer", INFO: "Info"}

INSTRUCTIONS = {
    VERIFIER: (
        "You are the Verifier of a research team. Decide whether the information gathered "
        "so far is enough to answer the question. Reply <verify>yes</verify> if it is, "
        "otherwise <verify>no</verify>."
    ),
    SEARCHER: (
        "You are the Search Agent of a research team. Write one search query that finds "
        "the information still missing to answer the question, inside <search> and "
        "</search>."
    ),
    ANSWERER: (
        "You are the Answer Agent of a research team. Answer the question using the "
        "information gathered. Give only the short answer inside <answer> and </answer>."
    ),
}
TINY_INSTRUCTIONS = {VERIFIER: "Enough?", SEARCHER: "Search.", ANSWERER: "Answer."}

MAX_QUERY_CHARS = 256
"""A longer <search> query is an invalid action (a runaway generation, not a query)."""

_VERIFY = re.compile(r"<verify>\s*(yes|no)\s*</verify>", re.IGNORECASE)
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class HasText(Protocol):
    """A retrieved passage as the team context shows it (drmas.retrieval.corpus.Passage)."""

    @property
    def title(self) -> str: ...

    @property
    def text(self) -> str: ...


def render_passages(passages: Sequence[HasText], style: str) -> str:
    """The `Info:` entry of a search: texts joined by ` | ` (plain) or numbered with their
    titles (chat)."""
    if not passages:
        return "(no results)"
    if style == "plain":
        return " | ".join(" ".join(p.text.split()) for p in passages)
    return " ".join(
        f"[{i}] ({p.title}) {' '.join(p.text.split())}" for i, p in enumerate(passages, 1)
    )


LAYOUT = TeamLayout(LABELS, " agent")
context_lines = LAYOUT.context_lines
plain_prompt = LAYOUT.plain_prompt
chat_messages = LAYOUT.chat_messages


def parse_verdict(text: str) -> bool | None:
    """True = enough information, False = search more, None = no <verify> tag (an invalid
    action; routed like "no" unless it is the last turn)."""
    found = _VERIFY.findall(text)
    return found[-1].lower() == "yes" if found else None


def parse_search(text: str) -> str | None:
    """The last complete `<search>query</search>` with its whitespace folded, or None when
    there is none, it is empty, or it is longer than MAX_QUERY_CHARS."""
    found = _SEARCH.findall(text)
    if not found:
        return None
    query = " ".join(found[-1].split())
    return query if 0 < len(query) <= MAX_QUERY_CHARS else None


def parse_answer(text: str) -> str | None:
    """The last complete `<answer>...</answer>` (whitespace folded), or None when there is
    none or it is empty."""
    found = _ANSWER.findall(text)
    if not found:
        return None
    answer = " ".join(found[-1].split())
    return answer or None


def verifier_response(enough: bool) -> str:
    return f" <verify>{'yes' if enough else 'no'}</verify>"


def search_response(query: str) -> str:
    """The warm start's Search action. The space after the tag (the parsers fold it away)
    makes the query's first word the same token as in the question and the passages for
    the tiny model's word tokenizer (" Taki", not ">Taki"): copying a name is copying its
    tokens."""
    return f" <search> {query}</search>"


def answer_response(answer: str) -> str:
    """The warm start's Answer action (a space after the tag, as in search_response)."""
    return f" <answer> {answer}</answer>"
