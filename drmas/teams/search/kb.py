"""A synthetic knowledge base of fictional people, cities and countries (the search team's
task), and the questions it answers.

Facts are made up, so no model knows them in advance: the answer has to come from the
retrieved passages. Every person has two passages (`Bo Taki was born in Lumo.`, `Bo Taki
works as a baker.`) and every city one (`Lumo is a city in Orsa.`); titles are the entity
names. Passages stay under ~30 characters, so that the question, two searches and three
passages each fit the tiny model's 512 positions even one character per token.

Names are syllable words: first names of 2-3 letters (`Bo`, `Kat`), surnames, cities and
countries of 4 (`Taki`, `Lumo`), the last three drawn without replacement from one pool so
a name token means one kind of entity. People share first names and surnames, so a search
for one person also finds namesakes: bm25 has distractors to rank below the right passages.
Everything is a pure function of the spec (no global random state); building 50 000 people
takes about a second. The names depend only on the sizes and the facts on the seed, so
the search warm start can teach the tiny model the names it will copy on knowledge bases
whose facts it redraws every batch, and never see the RL task's facts.

The search team supplies this corpus to its retriever (`search_corpus`): retrieval takes a
corpus path and knows nothing of the knowledge base.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from drmas.cache import build_folder, default_cache_dir
from drmas.protocol.messages import Task

if TYPE_CHECKING:
    from drmas.config.retrieval import RetrieverConfig
    from drmas.config.task import TaskConfig

KB_VERSION = 2
"""Bump when the generator's output changes for the same spec (cached corpora are rebuilt)."""
CORPUS_FILE = "corpus.jsonl"
"""The corpus's name in its cache folder (`ensure_corpus`)."""

CONSONANTS = "bdfghklmnprstvz"
VOWELS = "aeiou"
CODAS = ("sh", "th", "rn", "rk", "nd", "st", "lm", "nt")
"""Word-final consonant pairs of the CVCC words (`Vesh`, `Baln`)."""
JOBS = (
    "baker",
    "farmer",
    "potter",
    "tailor",
    "miner",
    "sailor",
    "weaver",
    "singer",
    "doctor",
    "nurse",
    "cook",
    "smith",
    "guard",
    "judge",
    "pilot",
    "hunter",
)
"""Consonant-initial, so `works as a {job}` is always grammatical."""
STOPWORDS = "a an and are as at be but by for if in is it no not of on or the to was"
"""bm25s's English stopwords (dropped from queries and passages)."""
RESERVED = frozenset(f"{STOPWORDS} born city works what where which who job country".split())
"""Words a name must not be: English stopwords (bm25 drops them from queries) and the words
of the passage and question templates."""


@dataclass(frozen=True)
class KBSpec:
    """Size and seed of a knowledge base; the same spec always gives the same one."""

    num_people: int = 200
    """People (2 passages and 3 questions each)."""
    seed: int = 0
    """Seed of the facts (who was born where, jobs, which country each city is in) and of
    the train/val split. The names depend only on the sizes: knowledge bases that differ
    only in seed have the same people, cities and countries with different facts (the
    search warm start teaches the names and the format on other facts than RL's)."""
    num_cities: int = 0
    """Cities (1 passage each); 0 = num_people // 10, at least 4, at most 2000."""
    num_countries: int = 0
    """Countries (no passage; reached through a city); 0 = num_cities // 4, at least 2."""
    num_surnames: int = 0
    """Distinct surnames; 0 = num_people // 4, at least 8, at most the 4-letter words that
    cities and countries leave."""


@dataclass(frozen=True)
class QA:
    """One question, its accepted answers (the first is the canonical one), how many
    passages it takes (hops) and its kind (born | job | country)."""

    question: str
    answers: tuple[str, ...]
    hops: int
    kind: str


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    job: str


@dataclass
class KnowledgeBase:
    """People, cities (name -> country) and the corpus; passages are dicts with id, title,
    text, ids are their positions (cities first, then each person's born and job passage)."""

    spec: KBSpec
    people: list[Person]
    cities: dict[str, str]
    passages: list[dict[str, str]] = field(default_factory=list)

    def questions(self) -> list[QA]:
        """Three questions per person, in person order: born, job, country."""
        return [qa for person in self.people for qa in person_questions(person, self.cities)]


def person_questions(person: Person, cities: dict[str, str]) -> list[QA]:
    p = person.name
    return [
        QA(f"Where was {p} born?", (person.city,), 1, "born"),
        QA(f"What is {p}'s job?", (person.job, f"a {person.job}"), 1, "job"),
        QA(f"In which country was {p} born?", (cities[person.city],), 2, "country"),
    ]


def born_text(person: Person) -> str:
    return f"{person.name} was born in {person.city}."


def job_text(person: Person) -> str:
    return f"{person.name} works as a {person.job}."


def city_text(city: str, country: str) -> str:
    return f"{city} is a city in {country}."


def short_words() -> list[str]:
    """First names: CV and CVC syllables (1,200 before removing reserved words)."""
    words = [c + v for c in CONSONANTS for v in VOWELS]
    words += [c + v + d for c in CONSONANTS for v in VOWELS for d in CONSONANTS]
    return [w.capitalize() for w in words if w not in RESERVED]


def long_words() -> list[str]:
    """Surnames, cities, countries: CVCV and CVCC words (~6,200)."""
    words = ["".join(t) for t in itertools.product(CONSONANTS, VOWELS, CONSONANTS, VOWELS)]
    words += [c + v + cc for c in CONSONANTS for v in VOWELS for cc in CODAS]
    return [w.capitalize() for w in words if w not in RESERVED]


def sizes(spec: KBSpec) -> tuple[int, int, int]:
    """(cities, countries, surnames) with the defaults of KBSpec resolved."""
    cities = spec.num_cities or min(2000, max(4, spec.num_people // 10))
    countries = spec.num_countries or max(2, cities // 4)
    left = len(long_words()) - cities - countries
    surnames = spec.num_surnames or min(left, max(8, spec.num_people // 4))
    return cities, countries, surnames


def build(spec: KBSpec) -> KnowledgeBase:
    num_cities, num_countries, num_surnames = sizes(spec)
    firsts, pool = short_words(), long_words()
    if spec.num_people < 1 or num_countries > num_cities:
        raise ValueError(f"a knowledge base needs people and cities >= countries, got {spec}")
    if num_cities + num_countries + num_surnames > len(pool):
        raise ValueError(
            f"{spec}: {num_cities} cities + {num_countries} countries + {num_surnames} "
            f"surnames exceed the {len(pool)} four-letter names; lower num_cities or num_surnames"
        )
    if spec.num_people > len(firsts) * num_surnames:
        raise ValueError(
            f"{spec}: only {len(firsts) * num_surnames} distinct full names with "
            f"{num_surnames} surnames; raise num_surnames"
        )
    names = random.Random(
        f"drmas.kb:names:{spec.num_people}:{num_cities}:{num_countries}:{num_surnames}"
    )
    words = names.sample(pool, num_cities + num_countries + num_surnames)
    cities_list = words[:num_cities]
    countries = words[num_cities : num_cities + num_countries]
    surnames = words[num_cities + num_countries :]
    rng = random.Random(f"drmas.kb:{spec.seed}")
    # Every country has a city: num_countries cities (a different few per seed) go one to
    # each, the others to random countries.
    first_cities = set(rng.sample(range(num_cities), num_countries))
    countries_left = iter(rng.sample(countries, num_countries))
    cities = {
        city: next(countries_left) if i in first_cities else rng.choice(countries)
        for i, city in enumerate(cities_list)
    }
    # Distinct (first, surname) pairs; sampling pair indices avoids a retry loop.
    pairs = names.sample(range(len(firsts) * num_surnames), spec.num_people)
    people = [
        Person(
            f"{firsts[i // num_surnames]} {surnames[i % num_surnames]}",
            rng.choice(cities_list),
            rng.choice(JOBS),
        )
        for i in pairs
    ]
    passages = [{"title": c, "text": city_text(c, k)} for c, k in cities.items()]
    for person in people:
        passages.append({"title": person.name, "text": born_text(person)})
        passages.append({"title": person.name, "text": job_text(person)})
    passages = [{"id": str(i), **p} for i, p in enumerate(passages)]
    return KnowledgeBase(spec, people, cities, passages)


def tasks(spec: KBSpec, num_val: int) -> tuple[list[QA], list[QA]]:
    """(train, val). Split by person: val questions come from people none of whose
    questions is in train, so a val answer is never a fact the policy was rewarded on.
    Val takes all questions of ceil(num_val / 3) people, shuffled and cut to num_val."""
    kb = build(spec)
    if not 0 <= num_val <= 3 * len(kb.people):
        raise ValueError(f"num_val={num_val} must be in 0..{3 * len(kb.people)} (3 per person)")
    rng = random.Random(f"drmas.kb:{spec.seed}:split")
    order = list(range(len(kb.people)))
    rng.shuffle(order)
    num_val_people = -(-num_val // 3)
    val = [qa for i in order[:num_val_people] for qa in person_questions(kb.people[i], kb.cities)]
    train = [qa for i in order[num_val_people:] for qa in person_questions(kb.people[i], kb.cities)]
    rng.shuffle(val)
    rng.shuffle(train)
    return train, val[:num_val]


def write_corpus(kb: KnowledgeBase, path: str | Path) -> None:
    """JSONL (id, title, text), written to a temporary file and renamed into place."""
    _write_jsonl((json.dumps(p) for p in kb.passages), Path(path))


def write_questions(qas: Sequence[QA], path: str | Path) -> None:
    """JSONL in the NQ / Search-R1 shape: question, golden_answers, data_source="kb"."""
    rows = (
        json.dumps(
            {"question": qa.question, "golden_answers": list(qa.answers), "data_source": "kb"}
        )
        for qa in qas
    )
    _write_jsonl(rows, Path(path))


def corpus_key(spec: KBSpec) -> str:
    digest = hashlib.sha256(
        json.dumps({"spec": asdict(spec), "version": KB_VERSION}, sort_keys=True).encode()
    ).hexdigest()[:12]
    return f"people{spec.num_people}-seed{spec.seed}-{digest}"


def ensure_corpus(spec: KBSpec, cache_dir: str | Path | None) -> Path:
    """`<cache>/kb/<key>/corpus.jsonl`, written once (drmas/cache.py: concurrent callers
    wait for the first one's build, and the folder only ever appears complete). `cache_dir`
    None is $DRMAS_CACHE, else ~/.cache/drmas, as for builtin models."""
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir()) / "kb"
    folder /= corpus_key(spec)
    build_folder(
        folder,
        lambda tmp: write_corpus(build(spec), tmp / CORPUS_FILE),
        lambda path: (path / CORPUS_FILE).is_file(),
    )
    return folder / CORPUS_FILE


def search_corpus(
    retriever: RetrieverConfig, task: TaskConfig, cache_dir: str | None
) -> Path | None:
    """The corpus the search team's retriever indexes (None for an http retriever: the
    server has its own): retriever.corpus_path when set, else for task.name=kb this
    knowledge base's, generated once into the cache. Retrieval itself knows no task: the
    team supplies its corpus here, and `drmas retriever` gets it through the team's
    `prepare`."""
    from drmas.retrieval import resolve_corpus_path

    def generated() -> Path | None:
        if task.name != "kb":
            return None
        spec = KBSpec(num_people=task.kb_num_people, seed=task.seed)
        return ensure_corpus(spec, cache_dir or None)

    return resolve_corpus_path(retriever, generated)


def _write_jsonl(lines: Iterator[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def task_source(cfg: TaskConfig) -> tuple[list[Task], list[Task]]:
    """`task.name=kb`: the knowledge base's questions (ids `kb:{split}:{i}`, every alias a
    gold answer)."""
    train, val = tasks(KBSpec(num_people=cfg.kb_num_people, seed=cfg.seed), cfg.num_val)

    def as_tasks(questions: list[QA], split: str) -> list[Task]:
        return [
            Task(f"kb:{split}:{i}", q.question, q.answers[0], "kb", list(q.answers))
            for i, q in enumerate(questions)
        ]

    return as_tasks(train, "train"), as_tasks(val, "val")
