"""Search-team warm-start transcripts: episodes over a synthetic knowledge base.

The tiny model has to start RL able to write `<verify>`, `<search>` and `<answer>` and to
copy names from the question and the `Info:` lines, or every episode earns reward 0. The
transcripts come from knowledge bases with the RL task's people, cities and countries
(the names depend only on the sizes) but facts redrawn for every batch, so what carries
over is the format, the names as tokens and copying, not the facts RL asks about. The
model's tokenizer is learned from these transcripts (`tokenizer_corpus`, vocab.py), so
every name is one token and copying it is copying one token. Each transcript is one agent call of an episode as the search
workflow runs it (T = 3: Verifier and Search Agent on turns 1-2, forced answer on turn 3),
with the workflow's own prompt helpers, so the text is byte-identical to what the model
sees in RL. Retrieval is simulated the way bm25 over the corpus ranks: an exact entity
name brings its own passages first, then passages sharing a name token.
"""

from __future__ import annotations

import logging
import random
import re
from dataclasses import dataclass, field, replace
from functools import cache
from typing import TYPE_CHECKING, Any

from drmas.models.warmstart import Pairs, TranscriptSource, generate
from drmas.retrieval.corpus import Passage
from drmas.teams.search import kb as kbmod
from drmas.teams.search.kb import QA, KBSpec, KnowledgeBase, Person
from drmas.teams.search.prompts import (
    ANSWERER,
    INFO,
    SEARCHER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    answer_response,
    parse_answer,
    parse_search,
    parse_verdict,
    plain_prompt,
    render_passages,
    search_response,
    verifier_response,
)
from drmas.teams.search.qa import exact_match

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("drmas.models")

# Transcript kinds: one agent call at one point of an episode.
VERIFY_FIRST = 0
"""Verifier, nothing gathered yet -> no."""
SEARCH_NAME = 1
"""Search Agent's first query -> the person's name from the question."""
VERIFY_ONE = 2
"""Verifier after one search -> yes for one-hop questions (the Info holds the answer), no
for two-hop ones."""
ANSWER_ONE = 3
"""Answer Agent after the Verifier's yes on a one-hop question -> copies the answer."""
SEARCH_CITY = 4
"""Search Agent after one search on a two-hop question -> the city named in the Info."""
ANSWER_LAST = 5
"""Answer Agent forced on the last turn after two searches -> the answer when an Info line
holds it, else a plausible entity of the right type from the Info."""
COPY_DRILL = 6
"""Not an agent call: random passages, then the same passages again (loss on the repeat).
Every repeated character is a copy target, so the model learns to copy (which all the
agents need) from ~10x more targets per step than the agent transcripts give."""
KINDS = (VERIFY_FIRST, SEARCH_NAME, VERIFY_ONE, ANSWER_ONE, SEARCH_CITY, ANSWER_LAST)
KIND_AGENT = {
    VERIFY_FIRST: VERIFIER,
    SEARCH_NAME: SEARCHER,
    VERIFY_ONE: VERIFIER,
    ANSWER_ONE: ANSWERER,
    SEARCH_CITY: SEARCHER,
    ANSWER_LAST: ANSWERER,
}


@dataclass(frozen=True)
class SearchSpec:
    """What the search warm start trains on."""

    kb: KBSpec = field(default_factory=lambda: KBSpec(num_people=200, seed=1000))
    """Knowledge base of the transcripts: the RL task's size (task.kb_num_people), hence
    its names, but every batch redraws the facts (seed = this seed + a random offset), so
    no fact can be memorised and the only way to answer is to read the Info lines. The
    model learns the names it will have to copy and how to find them in context; the RL
    task's facts (seed 0) it never sees."""
    top_k: int = 3
    """Passages per simulated search (retriever.top_k of search_tiny)."""
    kind_weights: tuple[float, ...] = (0.06, 0.2, 0.12, 0.2, 0.2, 0.22, 0.0)
    """Mix of the kinds VERIFY_FIRST .. ANSWER_LAST, then COPY_DRILL, after the curriculum
    (one kind per batch: their lengths differ by 3x)."""
    curriculum: tuple[tuple[float, tuple[float, ...]], ...] = (
        (0.3, (0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0)),
        (0.2, (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
        (0.15, (0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0)),
    )
    """Phases before kind_weights: (fraction of the steps, kind weights). Copying a name
    out of the context is what the tiny model finds hard, and it learns it suddenly, for
    one kind of copy at a time: mixed with the other kinds it never starts, alone it
    jumps from chance to ~100 % after 400-600 steps. So the first phase is nothing but
    answers after one search (the word after `born in` / `works as a`; that same copy then
    serves the second query and the forced answer, phase three). Measured with batch 16,
    lr 1e-3 (1.5e-3 never started copying), 2000 steps (search_tiny, ~4.5 min here):
    greedy accuracies verdicts 1.0, answer after one search 1.0, second query 1.0, forced
    answer 0.36, whole episodes 0.20 EM (0.22 at temperature 1). The first query (the
    full name out of the question) does not take after the answer copy has: 0.00 after
    400 steps of phase two, and the finished model gives the full name a probability of
    ~0.002, so its episodes reach the asked-about person in ~1 % of cases and the 0.20
    EM is mostly guessing. The other order (first queries first, 300-480 steps) learns
    the first query (0.92-1.0) but then not the answer copy (0.03-0.08), and episodes
    reach only 0.09-0.12. Hence search_tiny gives its Search Agent a warm start of its
    own (SEARCH_QUERIES)."""
    verifier_label_noise: float = 0.1
    """Fraction of Verifier transcripts whose verdict is flipped, so RL still has verdicts
    to explore (and the other agents see the states a wrong verdict leads to)."""
    off_query_frac: float = 0.15
    """Fraction of ANSWER_LAST transcripts whose second query was not the right city (a
    namesake's city or the name again), so the forced answer is not always in the Info."""
    country_frac: float = 0.6
    """Fraction of ANSWER_LAST transcripts on two-hop questions (the rest are one-hop
    questions whose Verifier wrongly asked for a second search)."""
    full_name_query_frac: float = 1.0
    """Fraction of first-query transcripts (SEARCH_NAME) that search the person's full
    name; the rest search the surname alone, which bm25 ranks among the surname's
    namesakes (a vaguer habit that RL has to grow out of; see SEARCH_QUERIES)."""
    mixed_queries_from: float = 0.0
    """Progress (fraction of the steps) from which full_name_query_frac applies; before it
    every first query is the full name. Mixed from the start, the majority copy (the
    surname) takes and the full name never does (P ~0 after 1200 steps at 30 %)."""
    seed: int = 0
    """Seed of the transcript stream and of the model's initialisation."""
    kb_version: int = kbmod.KB_VERSION
    """The knowledge-base generator's version (in the model cache key with the rest)."""


SEARCH = SearchSpec()

_WORD = re.compile(r"[a-z0-9]+")
_BORN = re.compile(r"was born in (\w+)\.")
_JOB = re.compile(r"works as a (\w+)\.")
_COUNTRY = re.compile(r"is a city in (\w+)\.")
_PLAUSIBLE = {"born": _BORN, "job": _JOB, "country": _COUNTRY}


class SimRetriever:
    """bm25-like ranking over a knowledge base's corpus, as drmas.retrieval.bm25 returns
    it on these short passages (a person's born passage before their job passage, both
    before namesakes). Words as bm25 tokenises them: lower case, 2+ characters, stopwords
    dropped."""

    def __init__(self, kb: KnowledgeBase, top_k: int) -> None:
        self.kb, self.top_k = kb, top_k
        self.passages = [Passage(p["id"], p["title"], p["text"]) for p in kb.passages]
        self.by_title: dict[str, list[int]] = {}
        self.by_word: dict[str, list[int]] = {}
        for i, p in enumerate(self.passages):
            self.by_title.setdefault(p.title.lower(), []).append(i)
            for word in _words(f"{p.title} {p.text}"):
                self.by_word.setdefault(word, []).append(i)

    def search(self, query: str, rng: random.Random) -> list[Passage]:
        """Like BM25Retriever: passages titled exactly the query first, then by the number
        of query words they share, ties in corpus order; none that shares no word. (`rng`
        is kept for retrievers that sample.)"""
        exact = list(self.by_title.get(" ".join(query.lower().split()), []))
        shared: dict[int, int] = {}
        for word in _words(query):
            for i in self.by_word.get(word, []):
                shared[i] = shared.get(i, 0) + 1
        others = sorted((i for i in shared if i not in exact), key=lambda i: (-shared[i], i))
        return [self.passages[i] for i in (exact + others)[: self.top_k]]


def _words(text: str) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if len(w) >= 2 and w not in kbmod.RESERVED}


@cache
def retriever_for(kb_spec: KBSpec, top_k: int) -> SimRetriever:
    return SimRetriever(kbmod.build(kb_spec), top_k)


def best_answer(qa: QA, infos: list[str]) -> str:
    """What the Answer Agent should say: the gold answer when an Info line holds it, else
    the first entity of the asked type in the Info (a wrong but well-formed guess), else
    the first word of the last Info."""
    text = " | ".join(infos)
    gold = qa.answers[0]
    if gold in _words_cased(text):
        return gold
    found = _PLAUSIBLE[qa.kind].findall(text) or _BORN.findall(text)
    return found[0] if found else (text.split() or [gold])[0].strip(".|")


def _words_cased(text: str) -> set[str]:
    return set(re.findall(r"\w+", text))


def transcript(
    rng: random.Random, spec: SearchSpec, retriever: SimRetriever, kind: int
) -> tuple[str, str]:
    """(prompt, response) of one agent call of kind `kind` in the plain tiny format."""
    kb = retriever.kb
    person = rng.choice(kb.people)
    born, job, country = kbmod.person_questions(person, kb.cities)
    no, yes = (VERIFIER, verifier_response(False)), (VERIFIER, verifier_response(True))

    def searched(query: str) -> list[tuple[str, str]]:
        passages = retriever.search(query, rng)
        return [(SEARCHER, search_response(query)), (INFO, render_passages(passages, "plain"))]

    def verdict(enough: bool) -> str:
        return verifier_response(enough != (rng.random() < spec.verifier_label_noise))

    if kind == COPY_DRILL:
        text = render_passages(rng.sample(retriever.passages, spec.top_k), "plain")
        return f"Repeat.\n{text}\nAgain:", f" {text}"
    if kind == VERIFY_FIRST:
        qa, turns, response = rng.choice((born, job, country)), [], verdict(False)
    elif kind == SEARCH_NAME:
        qa, turns = rng.choice((born, job, country)), [no]
        # (no draw at 1.0: the stream, hence the search warm start, stays as it was)
        full = spec.full_name_query_frac >= 1.0 or rng.random() < spec.full_name_query_frac
        response = search_response(person.name if full else person.name.split()[-1])
    elif kind == VERIFY_ONE:
        qa = rng.choice((born, job, country))
        turns = [no, *searched(person.name)]
        response = verdict(qa.answers[0] in _words_cased(turns[-1][1]))
    elif kind == ANSWER_ONE:
        qa = rng.choice((born, job))
        turns = [no, *searched(person.name), yes]
        response = answer_response(best_answer(qa, [turns[2][1]]))
    elif kind == SEARCH_CITY:
        qa, turns = country, [no, *searched(person.name), no]
        response = search_response(person.city)
    elif kind == ANSWER_LAST:
        qa = country if rng.random() < spec.country_frac else rng.choice((born, job))
        query = person.city
        if rng.random() < spec.off_query_frac:
            query = rng.choice((person.name, _namesake(rng, kb, person).city))
        turns = [no, *searched(person.name), no, *searched(query)]
        response = answer_response(best_answer(qa, [turns[2][1], turns[5][1]]))
    else:
        raise ValueError(f"unknown search transcript kind {kind}")
    prompt = plain_prompt(KIND_AGENT[kind], qa.question, turns, TINY_INSTRUCTIONS[KIND_AGENT[kind]])
    return prompt, response


def _namesake(rng: random.Random, kb: KnowledgeBase, person: Person) -> Person:
    """Another person (sharing a name word when one does; the searcher's likely confusion)."""
    first, last = person.name.split()
    near = [p for p in kb.people if p is not person and (first in p.name or last in p.name)]
    return rng.choice(near or kb.people)


def draw(rng: random.Random, n: int, progress: float = 0.0, spec: SearchSpec = SEARCH) -> Pairs:
    """A batch of one kind, drawn from the curriculum phase `progress` falls in (then
    from kind_weights)."""
    if progress < spec.mixed_queries_from:
        spec = replace(spec, full_name_query_frac=1.0)
    facts = replace(spec.kb, seed=spec.kb.seed + 1 + rng.randrange(1 << 30))
    retriever = SimRetriever(kbmod.build(facts), spec.top_k)
    weights, start = spec.kind_weights, 0.0
    for fraction, phase_weights in spec.curriculum:
        if start <= progress < start + fraction:
            weights = phase_weights
            break
        start += fraction
    kind = rng.choices((*KINDS, COPY_DRILL), weights=weights)[0]
    return [transcript(rng, spec, retriever, kind) for _ in range(n)]


# ---------------------------------------------------------------------------------------
# How good is the warm-started model (logged at the end of the build)

EVAL_KB = KBSpec()
"""The RL task's default knowledge base: facts the warm start never saw."""


def role_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    kind: int,
    temperature: float,
    n: int = 64,
    kb_spec: KBSpec = EVAL_KB,
    seed: int = 0,
) -> float:
    """Fraction of `n` held-out transcripts of `kind` (no label noise) where the model's
    parsed action equals the transcript's: verdict, query or answer."""
    spec = replace(SEARCH, verifier_label_noise=0.0, off_query_frac=0.0)
    retriever = retriever_for(kb_spec, spec.top_k)
    rng = random.Random(seed)
    pairs = [transcript(rng, spec, retriever, kind) for _ in range(n)]
    texts = generate(model, tokenizer, [p for p, _ in pairs], temperature, seed, 32)
    parse = {VERIFIER: parse_verdict, SEARCHER: parse_search, ANSWERER: parse_answer}
    action = parse[KIND_AGENT[kind]]
    return sum(action(t) == action(r) for t, (_, r) in zip(texts, pairs)) / n


def episode_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    qas: list[QA],
    temperature: float,
    kb_spec: KBSpec = EVAL_KB,
    max_turns: int = 3,
    top_k: int = 3,
    seed: int = 0,
    max_new_tokens: int = 32,
) -> float:
    """Mean exact match of whole episodes, run as the search workflow runs them (same
    routing, invalid actions continue) with every agent played by `model` and the
    simulated retriever: an estimate of the reward RL starts from."""
    retriever = retriever_for(kb_spec, top_k)
    rng = random.Random(seed)
    turns: list[list[tuple[str, str]]] = [[] for _ in qas]
    answers: list[str | None] = [None] * len(qas)

    def call(agent: str, which: list[int], call_seed: int) -> list[str]:
        """One batched generation for the episodes `which`; appends each text to its
        episode's context as the workflow does."""
        if not which:
            return []
        prompts = [
            plain_prompt(agent, qas[i].question, turns[i], TINY_INSTRUCTIONS[agent]) for i in which
        ]
        texts = generate(model, tokenizer, prompts, temperature, call_seed, max_new_tokens)
        for i, text in zip(which, texts):
            turns[i].append((agent, text))
        return texts

    active = list(range(len(qas)))
    for turn in range(max_turns):
        if turn == max_turns - 1:  # forced answer
            for i, text in zip(active, call(ANSWERER, active, seed + 3 * turn)):
                answers[i] = parse_answer(text)
            break
        verdicts = [parse_verdict(t) for t in call(VERIFIER, active, seed + 3 * turn + 1)]
        done = [i for i, v in zip(active, verdicts) if v]
        active = [i for i, v in zip(active, verdicts) if not v]  # no or invalid: search
        for i, text in zip(done, call(ANSWERER, done, seed + 3 * turn + 2)):
            answers[i] = parse_answer(text)
        for i, text in zip(active, call(SEARCHER, active, seed + 3 * turn + 3)):
            query = parse_search(text)
            if query is not None:
                turns[i].append((INFO, render_passages(retriever.search(query, rng), "plain")))
        if not active:
            break
    return sum(exact_match(a, qa.answers) for a, qa in zip(answers, qas)) / len(qas)


def report(model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    names = ("verify0", "search1", "verify1", "answer1", "search2", "answer2")
    for temperature in (0.0, 1.0):
        roles = {
            name: role_accuracy(model, tokenizer, kind, temperature)
            for name, kind in zip(names, KINDS)
        }
        _, val = kbmod.tasks(EVAL_KB, 96)
        em = episode_accuracy(model, tokenizer, val, temperature)
        log.info(
            "warm start done (temperature %g): %s, episode EM %.2f",
            temperature,
            ", ".join(f"{k} {v:.2f}" for k, v in roles.items()),
            em,
        )


VOCAB_SIZE = 1024
"""Most tokens of the search model's word tokenizer: the ~900 that the corpus below
yields (every name of a 200-person knowledge base and every template word, each with its
leading space) fit."""


def tokenizer_corpus(n: int = 4000) -> list[str]:
    """Transcripts of every kind (the stream's own generator on its own seed) that the
    word tokenizer's merges are learned from."""
    rng = random.Random(SEARCH.seed + 1)
    texts: list[str] = []
    while len(texts) < n:
        texts += [p + r for p, r in draw(rng, 8, rng.random())]
    return texts


SOURCE = TranscriptSource(
    seed=SEARCH.seed,
    spec=SEARCH,
    instructions=TINY_INSTRUCTIONS,
    draw=draw,
    report=report,
    tokenizer="words",
    tokenizer_corpus=tokenizer_corpus,
    vocab_size=VOCAB_SIZE,
)


SEARCH_QUERIES = replace(
    SEARCH,
    kind_weights=(0.0, 0.5, 0.0, 0.0, 0.5, 0.0, 0.0),
    curriculum=(
        (0.4, (0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0)),
        (0.35, (0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0)),
    ),
    full_name_query_frac=0.3,
    mixed_queries_from=0.75,
)
"""The Search Agent's own warm start (warmstart.workflow=search_queries): its two calls
only, first queries then second queries, then both. Learned alone, each copy takes (the
first query ~1.0 greedy after 1200 steps). In the last quarter only 30 % of its first
queries are the full name; the rest are the surname, which bm25 ranks among namesakes,
so the team starts well below what its agents can do and RL has one clear thing to find:
the full-name query pays."""


def draw_queries(rng: random.Random, n: int, progress: float = 0.0) -> Pairs:
    return draw(rng, n, progress, SEARCH_QUERIES)


def report_queries(model: Any, tokenizer: PreTrainedTokenizerBase) -> None:
    """The Search Agent's two queries against the full-name / city reference."""
    for temperature in (0.0, 1.0):
        first = role_accuracy(model, tokenizer, SEARCH_NAME, temperature)
        second = role_accuracy(model, tokenizer, SEARCH_CITY, temperature)
        log.info(
            "search-queries warm start done (temperature %g): full-name first query %.2f, "
            "city second query %.2f",
            temperature,
            first,
            second,
        )


SOURCE_QUERIES = replace(SOURCE, spec=SEARCH_QUERIES, draw=draw_queries, report=report_queries)
