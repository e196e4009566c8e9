"""builtin:tiny-qwen2: a real checkpoint folder, a character-level tokenizer, a cache that
builds once and atomically, and warm-start transcripts in the workflow's exact format.
The broker's sample decoder against transformers' on both builtins (builtin:smollm2-135m
itself: tests/unit/test_smollm2.py)."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from drmas.config.model import WarmStartConfig
from drmas.models import builtin, warmstart
from drmas.teams.math import prompts as mp
from drmas.teams.math import transcripts as mt

torch.set_num_threads(1)

TINY = WarmStartConfig(steps=5, batch_size=4, lr=1e-3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return builtin.resolve_model_path("builtin:tiny-qwen2", str(cache), TINY)


def test_folder_is_a_hugging_face_checkpoint(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        assert (folder / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (128, 4, 4)
    assert (cfg.intermediate_size, cfg.max_position_embeddings) == (512, 512)
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tokenizer) == 3 + 96
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
    assert cfg.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert cfg.pad_token_id == tokenizer.pad_token_id
    assert 0.5e6 < sum(p.numel() for p in model.parameters()) < 1.2e6


def test_tokenizer_is_character_level_and_round_trips(folder: Path) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = (
        "Solve.\nQuestion: 12+7\nSolver: \\boxed{19}\nVerifier: <verify>no</verify>\n"
        "  two  spaces, trailing space \n\n!?/=:.-{}<>" + "".join(chr(c) for c in range(32, 127))
    )
    for tokenizer in (
        AutoTokenizer.from_pretrained(folder),
        PreTrainedTokenizerFast.from_pretrained(folder),
    ):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) == len(text)
        assert len(set(ids)) == len(set(text))  # one id per distinct character
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        eos = tokenizer.eos_token_id
        assert (
            tokenizer.decode([*ids, eos, tokenizer.pad_token_id], skip_special_tokens=True) == text
        )
        # Each character alone decodes to itself (incremental decoding works).
        assert "".join(tokenizer.decode([i]) for i in ids) == text


def test_cache_reuses_the_folder_without_rebuilding(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def must_not_build(*args: object) -> None:
        raise AssertionError("rebuilt a cached builtin")

    monkeypatch.setitem(builtin.BUILTINS, "tiny-qwen2", must_not_build)
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    again = builtin.resolve_model_path("builtin:tiny-qwen2", str(folder.parent), TINY)
    assert again == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def test_built_folder_is_readable_like_an_ordinary_folder(folder: Path) -> None:
    """Shared caches: 0755 folders and 0644 files, like the corpus and index caches."""
    assert folder.stat().st_mode & 0o7777 == 0o755
    files = [p for p in folder.rglob("*") if p.is_file()]
    assert files and {p.stat().st_mode & 0o7777 for p in files} == {0o644}


def test_cache_key_covers_what_changes_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    key = builtin.cache_key("tiny-qwen2", TINY)
    assert key.startswith("tiny-qwen2-")
    assert builtin.cache_key("tiny-qwen2", WarmStartConfig(steps=5, batch_size=4, lr=1e-3)) == key
    assert builtin.cache_key("tiny-qwen2", WarmStartConfig(steps=6, batch_size=4, lr=1e-3)) != key
    assert builtin.cache_key("tiny-qwen2", WarmStartConfig(steps=5, batch_size=4, lr=2e-3)) != key
    assert (
        builtin.cache_key("tiny-qwen2", WarmStartConfig(steps=5, batch_size=4, lr=1e-3, seed=1))
        != key
    )
    monkeypatch.setattr(builtin, "BUILDER_VERSION", builtin.BUILDER_VERSION + 1)
    assert builtin.cache_key("tiny-qwen2", TINY) != key
    monkeypatch.undo()
    monkeypatch.setitem(builtin.TINY_QWEN2, "hidden_size", 64)
    assert builtin.cache_key("tiny-qwen2", TINY) != key
    monkeypatch.undo()
    monkeypatch.setattr(builtin, "ALPHABET", builtin.ALPHABET + "\t")
    assert builtin.cache_key("tiny-qwen2", TINY) != key


def test_concurrent_builds_build_once_and_never_expose_a_partial_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    seen_partial: list[bool] = []

    def slow_builder(out: Path, warmstart: WarmStartConfig) -> None:
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(0.3)
        (out / "model.safetensors").write_text("weights")

    monkeypatch.setitem(builtin.BUILTINS, "tiny-qwen2", slow_builder)
    final = tmp_path / builtin.cache_key("tiny-qwen2", TINY)
    results: list[Path] = []

    def resolve() -> None:
        results.append(builtin.resolve_model_path("builtin:tiny-qwen2", str(tmp_path), TINY))

    def watch() -> None:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            if final.exists():
                seen_partial.append(not (final / "model.safetensors").exists())
            time.sleep(0.005)

    threads = [threading.Thread(target=resolve) for _ in range(3)] + [
        threading.Thread(target=watch)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [final] * 3
    assert calls[0] != final  # built under a temporary name
    assert seen_partial and not any(seen_partial)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [final.name]


def test_failed_build_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(out: Path, warmstart: WarmStartConfig) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("out of disk")

    monkeypatch.setitem(builtin.BUILTINS, "tiny-qwen2", broken)
    with pytest.raises(RuntimeError, match="out of disk"):
        builtin.resolve_model_path("builtin:tiny-qwen2", str(tmp_path), TINY)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_resolve_plain_folders_and_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert builtin.resolve_model_path(str(tmp_path / "ckpt"), None) == tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        builtin.resolve_model_path(str(tmp_path / "missing"), None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        builtin.resolve_model_path(str(tmp_path / "empty"), None)
    with pytest.raises(ValueError, match="tiny-qwen2"):
        builtin.resolve_model_path("builtin:no-such-model", str(tmp_path))
    monkeypatch.setenv("DRMAS_CACHE", str(tmp_path / "env-cache"))
    assert builtin.default_cache_dir() == tmp_path / "env-cache"


def test_transcripts_use_the_workflow_prompt_format() -> None:
    rng = random.Random(3)
    spec = mt.ARITHMETIC
    solver, verifier = mp.TINY_INSTRUCTIONS[mp.SOLVER], mp.TINY_INSTRUCTIONS[mp.VERIFIER]
    question_re = r"(\d+)([+-])(\d+)"
    verdicts = []
    for kind in range(3):
        for _ in range(400):
            prompt, response = mt.transcript(rng, spec, kind)
            q = re.search(rf"Question: {question_re}\n", prompt)
            assert q is not None
            a, op, b = int(q.group(1)), q.group(2), int(q.group(3))
            assert 0 <= a <= spec.max_operand and 0 <= b <= spec.max_operand
            gold = str(a + b if op == "+" else a - b)
            question = f"{a}{op}{b}"
            if kind == 0:
                assert prompt == mp.plain_prompt(mp.SOLVER, question, [], solver)
                assert response == mp.solver_response(gold)
            elif kind == 1:
                shown = re.search(r"Solver: \\boxed\{(-?\d+)\}\n", prompt)
                assert shown is not None
                turns = [(mp.SOLVER, mp.solver_response(shown.group(1)))]
                assert prompt == mp.plain_prompt(mp.VERIFIER, question, turns, verifier)
                assert 0 < abs(int(shown.group(1)) - int(gold)) <= 3 or shown.group(1) == gold
                verdict = mp.parse_verdict(response)
                assert response == mp.verifier_response(bool(verdict))
                verdicts.append((shown.group(1) == gold, verdict))
            else:
                wrong = re.search(r"Solver: \\boxed\{(-?\d+)\}\n", prompt)
                assert wrong is not None and wrong.group(1) != gold
                turns = [
                    (mp.SOLVER, mp.solver_response(wrong.group(1))),
                    (mp.VERIFIER, mp.verifier_response(False)),
                ]
                assert prompt == mp.plain_prompt(mp.SOLVER, question, turns, solver)
                assert response == mp.solver_response(gold)
    correct_shown = sum(shown for shown, _ in verdicts) / len(verdicts)
    label_right = sum(shown == verdict for shown, verdict in verdicts) / len(verdicts)
    # the Verifier is shown right answers about as often as the warm Solver gives them (0.7)
    assert 0.6 < correct_shown < 0.8
    assert 0.72 < label_right < 0.88  # ~20 % label noise


def test_loss_covers_only_response_and_eos_and_prefix_sharing_is_exact(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    rng = random.Random(0)
    for kind in range(3):
        pairs = [mt.transcript(rng, mt.ARITHMETIC, kind) for _ in range(5)]
        prefix, ids, labels = warmstart.transcript_batch(tokenizer, pairs)
        assert tokenizer.decode(prefix).endswith("Question: ")
        for (_, response), row in zip(pairs, labels):
            target = row[row != -100].tolist()
            assert target == [
                *tokenizer(response, add_special_tokens=False).input_ids,
                tokenizer.eos_token_id,
            ]
        # Independent reference: each transcript alone, no padding, no shared prefix.
        total, count = 0.0, 0
        for prompt, response in pairs:
            p = tokenizer(prompt, add_special_tokens=False).input_ids
            r = [*tokenizer(response, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
            total += F.cross_entropy(logits, torch.tensor(r), reduction="sum").item()
            count += len(r)
        loss = warmstart.response_loss(model, prefix, ids, labels)
        assert loss.item() == pytest.approx(total / count, abs=1e-5)


def test_solver_accuracy_grades_boxed_answers(folder: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    rng = random.Random(1)
    questions = [mt.arithmetic_question(rng, mt.ARITHMETIC) for _ in range(4)]
    accuracy = mt.solver_accuracy(model, tokenizer, questions, temperature=1.0, max_new_tokens=4)
    assert 0.0 <= accuracy <= 1.0


def test_warm_start_never_shows_a_validation_question() -> None:
    """The default run validates on held-out questions that nothing trained on: RL never
    leases them (tasks/arithmetic.py) and the warm start never writes them."""
    from drmas.config import load_config
    from drmas.tasks.source import TaskSource

    cfg = load_config([])
    val = {t.question for t in TaskSource(cfg.task).val}
    assert len(val) == cfg.val.num_tasks >= 256
    rng = random.Random(0)
    seen = set()
    for kind in range(3):
        for _ in range(3000):
            prompt, _ = mt.transcript(rng, mt.ARITHMETIC, kind)
            q = re.search(r"Question: (\d+[+-]\d+)\n", prompt)
            assert q is not None
            seen.add(q.group(1))
    assert not seen & val
    assert len(seen) == 800 - len(val)  # every other question is still taught


def test_warm_start_seed_builds_another_model(tmp_path: Path) -> None:
    """Seed studies: warmstart.seed changes the initialisation and transcript stream; seed
    0 is the default model (same key as before seeds existed)."""
    from safetensors.torch import load_file

    def weights(seed: int) -> dict[str, torch.Tensor]:
        cfg = WarmStartConfig(steps=2, batch_size=2, lr=1e-3, seed=seed)
        folder = builtin.resolve_model_path("builtin:tiny-qwen2", str(tmp_path), cfg)
        return load_file(str(folder / "model.safetensors"))

    zero, one, zero_again = weights(0), weights(1), weights(0)
    name = "model.embed_tokens.weight"
    assert torch.equal(zero[name], zero_again[name])
    assert not torch.equal(zero[name], one[name])


# ------------------------------------------------------- the broker's sample decoder
def check_broker_decodes_like_transformers(model_folder: Path, tmp_path: Path) -> None:
    """The broker decodes sampled transcripts with `tokenizers` alone (no transformers or
    torch in its process): the text is transformers' decode, special tokens included. A
    folder whose config asks for transformers' space clean-up gets transformers itself."""
    import shutil

    from transformers import AutoTokenizer

    from drmas.broker.samples import _PlainDecoder, load_tokenizers

    reference = AutoTokenizer.from_pretrained(model_folder)
    decoder = load_tokenizers({"m": str(model_folder)})["m"]
    assert isinstance(decoder, _PlainDecoder)
    rng = random.Random(0)
    text = "Question: what is 12 + 30? Answer: \\boxed{42}."
    sequences = [reference(text)["input_ids"], list(reference.all_special_ids)]
    sequences += [[rng.randrange(len(reference)) for _ in range(40)] for _ in range(50)]
    for ids in sequences:
        assert decoder.decode(ids) == reference.decode(ids)

    cleaned = tmp_path / "cleaned"
    shutil.copytree(model_folder, cleaned)
    config = json.loads((cleaned / "tokenizer_config.json").read_text())
    (cleaned / "tokenizer_config.json").write_text(
        json.dumps({**config, "clean_up_tokenization_spaces": True})
    )
    assert not isinstance(load_tokenizers({"m": str(cleaned)})["m"], _PlainDecoder)


def test_broker_decodes_tiny_qwen2_like_transformers(folder: Path, tmp_path: Path) -> None:
    check_broker_decodes_like_transformers(folder, tmp_path)


@pytest.mark.slow
def test_broker_decodes_smollm2_like_transformers(smol: Path, tmp_path: Path) -> None:
    check_broker_decodes_like_transformers(smol, tmp_path)
