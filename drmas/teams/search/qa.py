"""Grading a short answer against gold answers: the team reward of a search episode.

The usual open-domain QA normalisation (as in SQuAD / NQ / Search-R1 evaluations): lower
case, punctuation removed, the articles a / an / the removed, whitespace folded. Exact
match (EM) is 1.0 when the normalised answer equals any normalised gold answer; token F1
is the best F1 over the gold answers. Both never raise: a missing answer scores 0.
`contains_answer` (the search team's role rewards) asks whether a text, such as the
passages of a search, holds a gold answer as whole normalised words.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(answer: str | None, golds: Sequence[str]) -> float:
    """1.0 if the normalised answer equals any normalised gold answer, else 0.0."""
    if answer is None:
        return 0.0
    norm = normalize_answer(answer)
    return float(any(norm == normalize_answer(g) for g in golds))


def f1_score(answer: str | None, golds: Sequence[str]) -> float:
    """Best token-level F1 of the normalised answer against any gold answer."""
    if answer is None:
        return 0.0
    tokens = normalize_answer(answer).split()
    best = 0.0
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        if not tokens or not gold_tokens:
            best = max(best, float(tokens == gold_tokens))
            continue
        common = sum((Counter(tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains_answer(text: str | None, golds: Sequence[str]) -> bool:
    """True if some gold answer, normalised, occurs in the normalised text as a run of whole
    words ("orsa" in "lumo is a city in orsa", not in "orsaland"). An empty gold answer
    never counts, so a gold that normalises to nothing cannot match every text."""
    if not text:
        return False
    padded = f" {normalize_answer(text)} "
    for gold in golds:
        norm = normalize_answer(gold)
        if norm and f" {norm} " in padded:
            return True
    return False
