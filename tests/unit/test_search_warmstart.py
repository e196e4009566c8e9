"""The search team's warm start: transcripts in the workflow's exact prompt format that fit
the tiny model's context, targets that follow the episode's logic, a retriever simulation
that ranks like bm25, and a build that writes its own cached folder."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from drmas.config.model import WarmStartConfig
from drmas.models import builtin
from drmas.teams.search import kb
from drmas.teams.search import prompts as sp
from drmas.teams.search import transcripts as st

torch.set_num_threads(1)

LABEL_AGENT = {label: agent for agent, label in sp.LABELS.items()}
NAME = re.compile(r"([A-Z][a-z]+ [A-Z][a-z]+)(?:'s| born)")
SPEC = st.SEARCH
RETRIEVER = st.retriever_for(SPEC.kb, SPEC.top_k)
TEXTS = {p["text"] for p in RETRIEVER.kb.passages}


@pytest.fixture(scope="module")
def words() -> PreTrainedTokenizerFast:
    """The search model's tokenizer, as its build makes it."""
    return builtin.make_tokenizer(st.SOURCE)


def parse_prompt(prompt: str) -> tuple[str, str, list[tuple[str, str]], str]:
    """(instruction, question, context turns, agent) read back from a plain prompt."""
    lines = prompt.split("\n")
    assert lines[1].startswith("Question: ")
    turns = []
    for line in lines[2:-1]:
        label, text = line.split(": ", 1)
        turns.append((LABEL_AGENT[label], text))
    assert lines[-1].endswith(":")
    return lines[0], lines[1].removeprefix("Question: "), turns, LABEL_AGENT[lines[-1][:-1]]


def samples(kind: int, n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [st.transcript(rng, SPEC, RETRIEVER, kind) for _ in range(n)]


@pytest.mark.parametrize("kind", st.KINDS)
def test_transcripts_are_the_workflow_prompts_byte_for_byte(
    kind: int, words: PreTrainedTokenizerFast
) -> None:
    tokenizer = words
    for prompt, response in samples(kind, 300, seed=kind):
        instruction, question, turns, agent = parse_prompt(prompt)
        assert agent == st.KIND_AGENT[kind]
        assert instruction == sp.TINY_INSTRUCTIONS[agent]
        # every context entry is what the helpers write for that agent / the retriever
        rebuilt = []
        for who, text in turns:
            if who == sp.VERIFIER:
                verdict = sp.parse_verdict(text)
                assert verdict is not None
                rebuilt.append((who, sp.verifier_response(verdict)))
            elif who == sp.SEARCHER:
                query = sp.parse_search(text)
                assert query is not None
                rebuilt.append((who, sp.search_response(query)))
            else:
                shown = text.split(" | ")
                assert 1 <= len(shown) <= SPEC.top_k and set(shown) <= TEXTS
                passages = [kb_passage(t) for t in shown]
                rebuilt.append((who, sp.render_passages(passages, "plain")))
        assert prompt == sp.plain_prompt(agent, question, rebuilt, instruction)
        # the response is one parseable action, as the helpers write it
        if agent == sp.VERIFIER:
            verdict = sp.parse_verdict(response)
            assert verdict is not None and response == sp.verifier_response(verdict)
        elif agent == sp.SEARCHER:
            query = sp.parse_search(response)
            assert query is not None and response == sp.search_response(query)
        else:
            answer = sp.parse_answer(response)
            assert answer is not None and response == sp.answer_response(answer)
        # prompt + response + EOS fit the tiny model's 512 positions
        ids = tokenizer(prompt + response, add_special_tokens=False).input_ids
        assert len(ids) + 1 <= builtin.TINY_QWEN2["max_position_embeddings"]


def kb_passage(text: str) -> sp.HasText:
    (found,) = [p for p in RETRIEVER.passages if p.text == text]
    return found


def test_targets_follow_the_episode_logic() -> None:
    """Hand-checkable rules: the first query is the name in the question, the second the
    city in that person's Info passage, answers are copied from the Info."""
    for prompt, response in samples(st.SEARCH_NAME, 200):
        name = NAME.search(prompt)
        assert name is not None and sp.parse_search(response) == name.group(1)
    for prompt, response in samples(st.SEARCH_CITY, 200):
        _, question, turns, _ = parse_prompt(prompt)
        assert question.startswith("In which country was ")
        name = question.removeprefix("In which country was ").removesuffix(" born?")
        city = re.search(rf"{name} was born in (\w+)\.", turns[2][1])
        assert city is not None and sp.parse_search(response) == city.group(1)
    for prompt, response in samples(st.ANSWER_ONE, 200):
        _, question, turns, _ = parse_prompt(prompt)
        answer = sp.parse_answer(response)
        assert answer is not None and turns[-1] == (sp.VERIFIER, "<verify>yes</verify>")
        name = NAME.search(question)
        assert name is not None
        assert f"{name.group(1)} was born in {answer}." in turns[2][1] or (
            f"{name.group(1)} works as a {answer}." in turns[2][1]
        )
    right = 0
    for prompt, response in samples(st.VERIFY_ONE, 400):
        _, question, turns, _ = parse_prompt(prompt)
        right += sp.parse_verdict(response) == (not question.startswith("In which country"))
    assert 0.85 < right / 400 < 0.95  # 10 % label noise
    first = [sp.parse_verdict(r) for _, r in samples(st.VERIFY_FIRST, 400)]
    assert 0.85 < first.count(False) / 400 < 0.95


def test_forced_answers_copy_the_info_or_guess_an_entity_of_the_asked_type() -> None:
    copied = 0
    for prompt, response in samples(st.ANSWER_LAST, 400):
        _, question, turns, _ = parse_prompt(prompt)
        assert [who for who, _ in turns] == [
            sp.VERIFIER,
            sp.SEARCHER,
            sp.INFO,
            sp.VERIFIER,
            sp.SEARCHER,
            sp.INFO,
        ]
        answer = sp.parse_answer(response)
        assert answer is not None
        info = turns[2][1] + " | " + turns[5][1]
        if question.startswith("In which country"):
            name = question.removeprefix("In which country was ").removesuffix(" born?")
            city = re.search(rf"{name} was born in (\w+)\.", info)
            assert city is not None
            truth = re.search(rf"{city.group(1)} is a city in (\w+)\.", info)
            if truth is not None:
                copied += 1
                assert answer == truth.group(1)
            elif "is a city in" in info:
                assert f"is a city in {answer}." in info
        assert re.search(rf"\b{answer}\b", info)
    assert copied > 170  # most second searches were the right city (~0.6 * 0.85 * 400)


def test_simulated_retriever_ranks_like_bm25() -> None:
    rng = random.Random(0)
    base = RETRIEVER.kb
    person = base.people[5]
    for _ in range(20):
        top = RETRIEVER.search(person.name, rng)
        assert len(top) == 3
        assert [p.text for p in top[:2]] == [kb.born_text(person), kb.job_text(person)]
        first, last = person.name.split()
        assert first in top[2].text or last in top[2].text  # a namesake
    city_top = RETRIEVER.search(person.city, rng)
    assert city_top[0].text == kb.city_text(person.city, base.cities[person.city])
    assert all(person.city in p.text for p in city_top)
    assert RETRIEVER.search("nothing matches this", rng) == []  # bm25 drops score 0


def test_simulated_retriever_agrees_with_bm25_on_the_rl_corpus(tmp_path: Path) -> None:
    from drmas.retrieval.bm25 import BM25Retriever

    base = kb.build(kb.KBSpec())
    path = tmp_path / "corpus.jsonl"
    kb.write_corpus(base, path)
    real, sim = BM25Retriever(path), st.SimRetriever(base, 3)
    queries = [p.name for p in base.people[:40]]
    agree = sum(
        [p.text for p in got][:2] == [p.text for p in sim.search(q, random.Random(0))][:2]
        for q, got in zip(queries, real.search(queries, 3))
    )
    assert agree == len(queries)  # the person's two passages, born first


def test_warm_start_names_are_the_rl_tasks_but_every_batch_redraws_the_facts() -> None:
    rl = kb.build(kb.KBSpec())
    assert SPEC.kb.num_people == rl.spec.num_people and SPEC.kb.seed != rl.spec.seed
    rl_facts = {kb.born_text(p) for p in rl.people}
    rng = random.Random(0)
    seen_facts: set[str] = set()
    for _ in range(6):
        for prompt, _response in st.draw(
            rng, 8, 0.9, replace(SPEC, kind_weights=(0, 0, 0, 0, 0, 1, 0))
        ):
            seen_facts |= set(
                re.findall(r"[A-Z][a-z]+ [A-Z][a-z]+ was born in [A-Z][a-z]+\.", prompt)
            )
    names = {fact.split(" was born")[0] for fact in seen_facts}
    assert names <= {p.name for p in rl.people}  # the RL task's names...
    # ...with facts drawn anew: about 1 in num_cities matches RL's by chance
    assert len(seen_facts & rl_facts) < 0.25 * len(seen_facts)
    assert len(seen_facts) > 20


def test_tiny_search_build_is_loadable_and_cached_apart_from_math(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reports: list[str] = []
    quiet = replace(st.SOURCE, report=lambda model, tokenizer: reports.append("search"))
    monkeypatch.setitem(builtin.WARM_STARTS, "search", quiet)
    cfg = WarmStartConfig(steps=3, batch_size=2, lr=1e-3, workflow="search")
    folder = builtin.resolve_model_path("builtin:tiny-qwen2", str(tmp_path), cfg)
    math_cfg = WarmStartConfig(steps=3, batch_size=2, lr=1e-3)
    assert builtin.cache_key("tiny-qwen2", math_cfg) != folder.name
    assert reports == ["search"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    # the evaluation helpers run on it (a barely trained model: any accuracy in [0, 1])
    acc = st.role_accuracy(model, tokenizer, st.SEARCH_NAME, temperature=1.0, n=4)
    _, val = kb.tasks(kb.KBSpec(), 4)
    em = st.episode_accuracy(model, tokenizer, val, temperature=1.0, max_new_tokens=8)
    assert 0.0 <= acc <= 1.0 and 0.0 <= em <= 1.0


def test_unknown_workflow_is_rejected() -> None:
    from drmas.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"warmstart.workflow='chess'.*'math'"):
        load_config(["models.solver.warmstart.workflow=chess"])


def test_copy_drill_repeats_real_passages_within_the_context() -> None:
    for prompt, response in samples(st.COPY_DRILL, 100):
        first = prompt.split("\n")[1]
        assert prompt == f"Repeat.\n{first}\nAgain:" and response == f" {first}"
        assert set(first.split(" | ")) <= TEXTS
        assert len(prompt) + len(response) + 1 <= builtin.TINY_QWEN2["max_position_embeddings"]


def test_word_tokenizer_makes_every_name_one_token_wherever_it_is_copied_from(
    words: PreTrainedTokenizerFast,
) -> None:
    """A name is the same single token in the question, the Info line and the action that
    copies it; so is every job."""
    assert len(words) <= st.VOCAB_SIZE
    for prompt, response in [*samples(st.SEARCH_CITY, 100), *samples(st.ANSWER_ONE, 100)]:
        copied = sp.parse_search(response) or sp.parse_answer(response)
        assert copied is not None
        (token,) = words(" " + copied, add_special_tokens=False).input_ids
        assert token in words(prompt, add_special_tokens=False).input_ids
        assert token in words(response, add_special_tokens=False).input_ids
    for person in RETRIEVER.kb.people[:50]:
        first, last = person.name.split()
        ids = words(f" {first} {last}", add_special_tokens=False).input_ids
        assert len(ids) == 2, words.convert_ids_to_tokens(ids)


def test_word_tokenizer_round_trips_any_text_and_is_deterministic(
    words: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    texts = [
        builtin.ALPHABET,
        "Question: What is 12+7?\n\\boxed{19} <verify>yes</verify>",
        "Zyxw qorpt, unseen words; 3.14159 and  two  spaces\n",
        *[p + r for p, r in samples(st.ANSWER_LAST, 20)],
    ]
    for text in texts:
        ids = words(text, add_special_tokens=False).input_ids
        assert words.decode(ids) == text
    # what engines and learners load from the folder gives the same ids
    builtin.save_tokenizer(words, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    builtin.check_loaded(loaded, words, "".join(texts), "words")
    with pytest.raises(RuntimeError, match="does not match"):
        builtin.check_loaded(loaded, builtin.char_tokenizer(), "".join(texts), "words")
    again = builtin.make_tokenizer(st.SOURCE)
    assert again.get_vocab() == words.get_vocab()
    assert len(words(texts[-1]).input_ids) * 3 < len(texts[-1])  # ~4 characters per token


def test_search_agent_warm_start_mixes_full_name_and_surname_queries() -> None:
    """SEARCH_QUERIES: only the Search Agent's two calls; in the last quarter 30 % of
    first queries are the full name, the rest the surname alone (RL has to find that the
    full name pays)."""
    spec = st.SEARCH_QUERIES
    retriever = st.SimRetriever(kb.build(spec.kb), spec.top_k)
    rng = random.Random(0)
    full = surname = 0
    for _ in range(600):
        prompt, response = st.transcript(rng, spec, retriever, st.SEARCH_NAME)
        query = sp.parse_search(response)
        names = [p.name for p in retriever.kb.people if p.name in prompt]
        assert query is not None and names
        if query in names:
            full += 1
        else:
            assert any(query == n.split()[-1] for n in names), (query, names)
            surname += 1
    assert 0.25 < full / 600 < 0.35
    # before mixed_queries_from, every first query is the full name (the copy takes first)
    early = [p for p in st.draw_queries(random.Random(1), 64, 0.1)]
    early_queries = [sp.parse_search(r) for _, r in early]
    assert all(q is not None and " " in q for q in early_queries), early_queries
    kinds = {st.KINDS[i] for i, w in enumerate(spec.kind_weights[:6]) if w > 0}
    assert kinds == {st.SEARCH_NAME, st.SEARCH_CITY}
    assert builtin.transcript_source("search_queries").spec is spec
    # the team's own warm start still searches the full name every time
    assert st.SEARCH.full_name_query_frac == 1.0
