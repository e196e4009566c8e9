"""The synthetic knowledge base: deterministic, unique names, every answer retrievable from
the corpus, two-hop answers that need two passages, a train/val split by person."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from drmas.config.retrieval import RetrieverConfig
from drmas.config.task import TaskConfig
from drmas.retrieval import load_corpus
from drmas.teams.search import kb
from drmas.teams.search.kb import KBSpec

SPEC = KBSpec(num_people=300, seed=7)


def test_same_spec_same_kb_other_seed_other_kb() -> None:
    a, b = kb.build(SPEC), kb.build(KBSpec(num_people=300, seed=7))
    assert a.passages == b.passages and a.questions() == b.questions()
    other = kb.build(KBSpec(num_people=300, seed=8))
    # the same names (they depend only on the sizes), other facts
    assert [p.name for p in other.people] == [p.name for p in a.people]
    assert set(other.cities) == set(a.cities)
    assert [(p.city, p.job) for p in other.people] != [(p.city, p.job) for p in a.people]
    assert other.cities != a.cities and other.passages != a.passages
    assert kb.tasks(SPEC, 30) == kb.tasks(SPEC, 30)


def test_names_are_unique_short_and_typed() -> None:
    base = kb.build(SPEC)
    names = [p.name for p in base.people]
    assert len(set(names)) == len(names) == 300
    surnames = {n.split()[1] for n in names}
    firsts = {n.split()[0] for n in names}
    countries = set(base.cities.values())
    # one name word, one kind of entity: bm25 on a city name never hits a surname
    assert not surnames & set(base.cities) and not surnames & countries
    assert not set(base.cities) & countries
    assert all(2 <= len(f) <= 3 for f in firsts) and all(len(s) == 4 for s in surnames)
    words = firsts | surnames | set(base.cities) | countries
    assert not {w.lower() for w in words} & kb.RESERVED
    # namesakes exist: a search for one person has distractors sharing a name word
    assert len(surnames) < len(names)
    assert len(base.cities) == 30 and len(countries) == 7  # num_people // 10, then // 4


def test_passages_ids_titles_and_lengths() -> None:
    base = kb.build(SPEC)
    assert len(base.passages) == 2 * 300 + 30
    assert [p["id"] for p in base.passages] == [str(i) for i in range(len(base.passages))]
    assert all(set(p) == {"id", "title", "text"} for p in base.passages)
    assert max(len(p["text"]) for p in base.passages) <= 32
    assert len({p["text"] for p in base.passages}) == len(base.passages)
    for p in base.passages:
        assert p["text"].startswith(p["title"] + " ")


def test_questions_and_answers_are_in_the_corpus() -> None:
    base = kb.build(SPEC)
    texts = {p["text"] for p in base.passages}
    qas = base.questions()
    assert len(qas) == 900
    assert {qa.kind for qa in qas} == {"born", "job", "country"}
    for qa in qas:
        name = re.search(r"(?:was|is) ([A-Z]\w+ [A-Z]\w+)(?:'s| born)", qa.question)
        assert name is not None, qa.question
        person = name.group(1)
        facts = [t for t in texts if t.startswith(person + " ")]
        assert len(facts) == 2  # born and job
        answer = qa.answers[0]
        if qa.kind == "born":
            assert qa.hops == 1 and f"{person} was born in {answer}." in texts
        elif qa.kind == "job":
            assert qa.hops == 1 and f"{person} works as a {answer}." in texts
            assert f"a {answer}" in qa.answers  # the alias
        else:
            # two hops: the person's passage names the city, only the city's names the country
            assert qa.hops == 2
            (born,) = [t for t in facts if " was born in " in t]
            city = born.removesuffix(".").split()[-1]
            assert f"{city} is a city in {answer}." in texts
            assert not any(answer in t for t in facts)


def test_split_is_by_person_and_deterministic() -> None:
    train, val = kb.tasks(SPEC, 40)
    assert len(val) == 40 and len(train) == 900 - 42  # 14 val people, 2 questions dropped
    names = re.compile(r"([A-Z]\w+ [A-Z]\w+)")

    def people(qas: list[kb.QA]) -> set[str]:
        found = set()
        for qa in qas:
            match = names.search(qa.question)
            assert match is not None
            found.add(match.group(1))
        return found

    assert len(people(val)) == 14 and not people(val) & people(train)
    assert {qa.kind for qa in val} == {"born", "job", "country"}
    with pytest.raises(ValueError, match="num_val"):
        kb.tasks(SPEC, 901)


def test_scales_to_a_100k_passage_corpus() -> None:
    big = kb.build(KBSpec(num_people=50_000))
    assert len(big.people) == len({p.name for p in big.people}) == 50_000
    assert len(big.cities) == 2000
    assert len(big.passages) == 102_000
    assert len(big.questions()) == 150_000


def test_too_many_names_is_an_error_that_says_what_to_change() -> None:
    with pytest.raises(ValueError, match="num_cities"):
        kb.build(KBSpec(num_people=100, num_cities=7000))


def test_corpus_and_questions_files(tmp_path: Path) -> None:
    base = kb.build(SPEC)
    kb.write_corpus(base, tmp_path / "corpus.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "corpus.jsonl").read_text().splitlines()]
    assert rows == base.passages
    train, _ = kb.tasks(SPEC, 10)
    kb.write_questions(train[:3], tmp_path / "q.jsonl")
    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    assert rows[0] == {
        "question": train[0].question,
        "golden_answers": list(train[0].answers),
        "data_source": "kb",
    }
    assert [p.name for p in tmp_path.iterdir()] != [] and not list(tmp_path.glob(".*.tmp"))


def test_ensure_corpus_writes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Path] = []
    real = kb.write_corpus

    def counting(base: kb.KnowledgeBase, path: str | Path) -> None:
        calls.append(Path(path))
        real(base, path)

    monkeypatch.setattr(kb, "write_corpus", counting)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(kb.ensure_corpus(SPEC, tmp_path)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1 and len(set(results)) == 1
    path = results[0]
    assert path.parent.parent == tmp_path / "kb" and path.name == "corpus.jsonl"
    assert calls[0].parent != path.parent  # written under a temporary name
    # readable like an ordinary folder, as the other cache folders (drmas/cache.py)
    assert (path.parent.stat().st_mode & 0o7777, path.stat().st_mode & 0o7777) == (0o755, 0o644)
    assert len(path.read_text().splitlines()) == 630
    assert kb.ensure_corpus(KBSpec(num_people=300, seed=8), tmp_path) != path
    monkeypatch.setenv("DRMAS_CACHE", str(tmp_path / "env"))
    assert kb.ensure_corpus(SPEC, None).is_relative_to(tmp_path / "env")


def test_search_corpus_is_the_given_one_else_the_kb_corpus(tmp_path: Path) -> None:
    """The search team supplies its corpus to retrieval: retriever.corpus_path when set,
    else for task.name=kb the knowledge base's, written once into the cache."""
    kb_task = TaskConfig(name="kb", kb_num_people=20, seed=1)
    path = kb.search_corpus(RetrieverConfig(), kb_task, str(tmp_path))
    assert path == kb.ensure_corpus(KBSpec(num_people=20, seed=1), tmp_path)
    assert path.is_relative_to(tmp_path)
    assert len(load_corpus(path)) == len(kb.build(KBSpec(num_people=20, seed=1)).passages)
    assert kb.search_corpus(RetrieverConfig(), kb_task, str(tmp_path)) == path

    given = tmp_path / "given.jsonl"
    given.write_text(json.dumps({"id": "1", "title": "t", "text": "x"}) + "\n")
    assert kb.search_corpus(RetrieverConfig(corpus_path=str(given)), kb_task, None) == given
    assert kb.search_corpus(RetrieverConfig(name="http"), kb_task, None) is None
    with pytest.raises(ValueError, match=r"set retriever.corpus_path"):
        kb.search_corpus(RetrieverConfig(), TaskConfig(), str(tmp_path))  # no kb: no corpus
