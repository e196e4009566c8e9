"""Builtin models: real Hugging Face checkpoint folders built on first use and cached.

`builtin:tiny-qwen2` is a character-level Qwen2 (~0.8 M parameters) that runs the whole
system on a laptop CPU. An untrained model never writes a parseable `\\boxed{}` answer, so
RL would see reward 0 everywhere and learn nothing; the warm start teaches it the plain
math-team transcript format on generated arithmetic until the Solver is right about half
the time (REFERENCE.md, calibration).

The folder is an ordinary checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json), so every engine and learner
loads it with `from_pretrained` like any other model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import json
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.actors.workflows.math_prompts import (
    SOLVER,
    TINY_INSTRUCTIONS,
    VERIFIER,
    parse_boxed,
    plain_prompt,
    solver_response,
    verifier_response,
)
from drmas.models.config import WarmStartConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast

log = logging.getLogger("drmas.models")

BUILTIN_PREFIX = "builtin:"
BUILDER_VERSION = 2
"""Bump when the builder's code changes what it writes; cached folders are rebuilt."""

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
"""Ids 0, 1, 2."""
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Printable ASCII (space, digits, letters, punctuation) and newline: one token each."""

TINY_QWEN2: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 512,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}
"""Architecture of builtin:tiny-qwen2 (vocab, eos and pad come from the tokenizer)."""

SMALL_QWEN2: dict[str, Any] = {
    **TINY_QWEN2,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "intermediate_size": 1024,
}
"""builtin:small-qwen2: same tokenizer, about 6x the parameters of tiny-qwen2 (for teams
whose agents run models of different sizes, e.g. a larger Verifier)."""

ARCHITECTURES = {"tiny-qwen2": TINY_QWEN2, "small-qwen2": SMALL_QWEN2}


@dataclass(frozen=True)
class ArithmeticSpec:
    """Questions of the warm start; matches the arithmetic task source's defaults."""

    max_operand: int = 19
    """Operands drawn from 0..max_operand."""
    ops: str = "+-"
    """Operations to draw from (one per question)."""
    max_wrong_offset: int = 3
    """A wrong Solver answer is off by 1..max_wrong_offset."""
    verifier_label_noise: float = 0.2
    """Fraction of Verifier transcripts whose verdict is flipped (an imperfect verifier)."""
    verifier_correct_frac: float = 0.7
    """Fraction of Verifier transcripts whose Solver answer is right. A balanced mix left
    the tiny Verifier at chance but nearly always saying "no" (entropy ~0.06), so correct
    first answers were thrown away and RL had no verdict to explore; like the Solver it
    judges, the warm-started Verifier should lean to approval and keep some doubt."""
    kind_weights: tuple[float, float, float] = (0.9, 0.05, 0.05)
    """Mix of transcript kinds: Solver first turn, Verifier, Solver after a rejection. The
    two later kinds are 2-3x longer; a few percent teaches their format, and more of them
    (within the same build time) costs Solver accuracy without making the tiny Verifier
    judge better than chance: RL is left to improve it."""
    seed: int = 0
    """Data and initialisation seed."""


ARITHMETIC = ArithmeticSpec()


# ---------------------------------------------------------------------------------------
# Public entry point


def default_cache_dir() -> Path:
    return Path(os.environ.get("DRMAS_CACHE") or Path.home() / ".cache" / "drmas")


def resolve_model_path(
    path: str, cache_dir: str | None, warmstart: WarmStartConfig | None = None
) -> Path:
    """A checkpoint folder for `path`: `builtin:<name>` is built (or reused from the cache);
    anything else must already be a Hugging Face causal-LM folder."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in BUILTINS:
            raise ValueError(f"unknown builtin model {name!r}; known: {sorted(BUILTINS)}")
        root = Path(cache_dir) if cache_dir else default_cache_dir()
        return _build_cached(name, root, warmstart if warmstart is not None else WarmStartConfig())
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(folder)!r} is not a Hugging Face checkpoint folder: expected a "
            f"directory with config.json (and weights, tokenizer files) or builtin:<name> "
            f"(known builtins: {sorted(BUILTINS)})"
        )
    return folder


def cache_key(name: str, warmstart: WarmStartConfig) -> str:
    """Folder name: the builtin's name and a hash of everything that determines its bytes."""
    spec = {
        "name": name,
        "architecture": ARCHITECTURES[name],
        "special_tokens": SPECIAL_TOKENS,
        "alphabet": ALPHABET,
        "warmstart": asdict(warmstart),
        "arithmetic": asdict(ARITHMETIC),
        "instructions": TINY_INSTRUCTIONS,
        "builder_version": BUILDER_VERSION,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return f"{name}-{digest}"


def _build_cached(name: str, root: Path, warmstart: WarmStartConfig) -> Path:
    """Build once per key. A folder under its final name is always complete: it is written
    under a temporary name and renamed; the lock keeps concurrent callers from building
    twice (the second one waits, then finds the folder)."""
    final = root / cache_key(name, warmstart)
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f"{final.name}.lock"):
        if (final / "config.json").is_file():
            return final
        # Holding the lock, any temporary folder of this key is a killed builder's leftover.
        for stale in root.glob(f".{final.name}.*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
        try:
            start = time.perf_counter()
            log.info("building builtin:%s in %s", name, final)
            BUILTINS[name](tmp, warmstart)
            os.rename(tmp, final)
            log.info("built builtin:%s in %.1f s", name, time.perf_counter() - start)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------
# tiny-qwen2


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ALPHABET; decoding concatenates (spaces preserved).

    Written as a byte-level BPE without merges (the vocabulary holds the byte-level symbol
    of each character: space is "Ġ", newline "Ċ"). transformers 5 loads any folder whose
    config says qwen2 with its own Qwen2Tokenizer pipeline, whatever tokenizer_config.json
    names; this tokenizer is exactly that pipeline, so every loader sees the same ids."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = _byte_symbols()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({symbols[ord(char)]: len(SPECIAL_TOKENS) + i for i, char in enumerate(ALPHABET)})
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, byte_fallback=False))
    core.normalizer = normalizers.NFC()
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        padding_side="left",
        model_max_length=TINY_QWEN2["max_position_embeddings"],
    )


def _byte_symbols() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + i) for i, b in enumerate(shifted)})
    return table


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    tokenizer.save_pretrained(folder)
    # Name the class that every transformers version resolves for a qwen2 folder and keep
    # the classic special_tokens_map.json next to it.
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config.pop("backend", None)
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _check_char_level(tokenizer: PreTrainedTokenizerBase) -> None:
    """Fail the build (not the RL run hours later) if the tokenizer a consumer loads is not
    one token per character with an exact round trip."""
    sample = ALPHABET + plain_prompt(VERIFIER, "12-19", [(SOLVER, solver_response("-7"))], "Check.")
    ids = tokenizer(sample, add_special_tokens=False).input_ids
    back = tokenizer.decode([*ids, tokenizer.eos_token_id], skip_special_tokens=True)
    if len(ids) != len(sample) or back != sample:
        raise RuntimeError(
            f"{type(tokenizer).__name__} loaded from the builtin folder is not character-level "
            f"({len(ids)} ids for {len(sample)} characters, round trip {back == sample}); "
            "this transformers version changed how tokenizers load"
        )


def build_tiny_qwen2(folder: Path, warmstart: WarmStartConfig) -> None:
    """builtin:tiny-qwen2, the embedded default (0.8M parameters)."""
    build_qwen2(folder, warmstart, TINY_QWEN2)


def build_small_qwen2(folder: Path, warmstart: WarmStartConfig) -> None:
    """builtin:small-qwen2 (about 5M parameters)."""
    build_qwen2(folder, warmstart, SMALL_QWEN2)


def build_qwen2(folder: Path, warmstart: WarmStartConfig, architecture: dict[str, Any]) -> None:
    """Write the tokenizer and a (warm-started) Qwen2ForCausalLM into `folder`."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    written = char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(written),
        bos_token_id=None,
        eos_token_id=written.eos_token_id,
        pad_token_id=written.pad_token_id,
        use_sliding_window=False,
        **architecture,
    )
    config.save_pretrained(folder)
    _save_tokenizer(written, folder)
    # Train on exactly what engines and learners will load.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _check_char_level(tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(ARITHMETIC.seed)
            model = Qwen2ForCausalLM(config).float()
            if warmstart.steps > 0:
                warm_start(model, tokenizer, warmstart, ARITHMETIC)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)


BUILTINS = {"tiny-qwen2": build_tiny_qwen2, "small-qwen2": build_small_qwen2}


# ---------------------------------------------------------------------------------------
# Warm start: supervised training on generated math-team transcripts


def arithmetic_question(rng: random.Random, spec: ArithmeticSpec) -> tuple[str, str]:
    """(question, gold answer) written as the arithmetic task source writes them: `12+7`."""
    a = rng.randint(0, spec.max_operand)
    b = rng.randint(0, spec.max_operand)
    op = rng.choice(spec.ops)
    return f"{a}{op}{b}", str(a + b if op == "+" else a - b)


def _wrong(rng: random.Random, gold: str, spec: ArithmeticSpec) -> str:
    offset = rng.randint(1, spec.max_wrong_offset) * rng.choice((-1, 1))
    return str(int(gold) + offset)


def transcript(rng: random.Random, spec: ArithmeticSpec, kind: int) -> tuple[str, str]:
    """(prompt, response) of one agent call in the plain tiny-instruction format; kind 0:
    Solver first turn, 1: Verifier, 2: Solver after a rejection."""
    question, gold = arithmetic_question(rng, spec)
    if kind == 0:  # Solver, first turn
        return plain_prompt(SOLVER, question, [], TINY_INSTRUCTIONS[SOLVER]), solver_response(gold)
    if kind == 1:  # Verifier judging one Solver answer (half right), with label noise
        correct = rng.random() < spec.verifier_correct_frac
        answer = gold if correct else _wrong(rng, gold, spec)
        verdict = correct != (rng.random() < spec.verifier_label_noise)
        turns = [(SOLVER, solver_response(answer))]
        prompt = plain_prompt(VERIFIER, question, turns, TINY_INSTRUCTIONS[VERIFIER])
        return prompt, verifier_response(verdict)
    # Solver after the Verifier rejected a wrong answer
    turns = [
        (SOLVER, solver_response(_wrong(rng, gold, spec))),
        (VERIFIER, verifier_response(False)),
    ]
    return plain_prompt(SOLVER, question, turns, TINY_INSTRUCTIONS[SOLVER]), solver_response(gold)


def transcript_batch(
    tokenizer: PreTrainedTokenizerBase, pairs: list[tuple[str, str]]
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(shared prefix ids, right-padded suffix ids, suffix labels).

    The prefix is what every prompt of the batch starts with ("Solve.\nQuestion: "); the
    labels are -100 except on the response tokens and the closing EOS. Right padding needs
    no attention mask: under the causal mask no real token sees the pads after it."""
    import torch

    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False).input_ids
    responses = tokenizer([r for _, r in pairs], add_special_tokens=False).input_ids
    # Keep at least one prompt token per row: it predicts the first response token.
    limit, shared = min(map(len, prompts)) - 1, 0
    while shared < limit and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    rows = [p[shared:] + r + [tokenizer.eos_token_id] for p, r in zip(prompts, responses)]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        first = len(prompt) - shared
        labels[i, first : len(row)] = ids[i, first : len(row)]
    return prompts[0][:shared], ids, labels


def response_loss(
    model: PreTrainedModel, prefix: list[int], ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy on the labelled tokens. The shared prefix runs once and its KV
    cache is broadcast over the batch (gradients flow through it): a third less compute
    for the short Solver transcripts."""
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    batch, width = ids.shape
    cache = None
    if prefix:
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix]), use_cache=True, **{_cache_kwarg(model): cache})
        layers: list[Any] = list(cache.layers)
        for layer in layers:
            layer.keys = layer.keys.expand(batch, -1, -1, -1)
            layer.values = layer.values.expand(batch, -1, -1, -1)
    positions = torch.arange(len(prefix), len(prefix) + width).expand(batch, -1)
    logits = model(
        input_ids=ids,
        position_ids=positions,
        use_cache=cache is not None,
        **{_cache_kwarg(model): cache},
    ).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5 renames `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: WarmStartConfig,
    spec: ArithmeticSpec,
) -> None:
    """AdamW on response tokens only; short warm-up, then linear decay to zero.

    Small batches and many steps: the model has to memorise most of the 800 sums and
    differences, and that depends on the number of updates more than on the number of
    transcripts (batch 8 x 2000 steps reaches ~85 % greedy where 32 x 800 reaches ~40 %
    in the same time). Weight decay and the final low-lr phase are what make the
    accuracy jump late in training."""
    import torch

    rng = random.Random(spec.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.98)
    )
    warmup = max(1, min(20, cfg.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        return cfg.lr * (cfg.steps - step) / (cfg.steps - warmup)

    model.train()
    start = time.perf_counter()
    for step in range(cfg.steps):
        # One kind per batch: the kinds differ in length by 2x, so mixing them would mostly
        # pay for padding.
        kind = rng.choices(range(3), weights=spec.kind_weights)[0]
        pairs = [transcript(rng, spec, kind) for _ in range(cfg.batch_size)]
        loss = response_loss(model, *transcript_batch(tokenizer, pairs))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            log.info(
                "warm start step %d/%d loss %.4f (%.1f s)",
                step + 1,
                cfg.steps,
                loss.item(),
                time.perf_counter() - start,
            )
    model.eval()
    eval_rng = random.Random(spec.seed + 1)
    questions = [arithmetic_question(eval_rng, spec) for _ in range(128)]
    greedy = solver_accuracy(model, tokenizer, questions, temperature=0.0)
    sampled = solver_accuracy(model, tokenizer, questions, temperature=1.0)
    log.info("warm start done: solver accuracy greedy %.2f, temperature 1 %.2f", greedy, sampled)


def solver_accuracy(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    questions: list[tuple[str, str]],
    temperature: float,
    seed: int = 0,
    max_new_tokens: int = 16,
) -> float:
    """Fraction of first-turn Solver answers whose `\\boxed{}` equals the gold answer."""
    import torch

    prompts = [plain_prompt(SOLVER, q, [], TINY_INSTRUCTIONS[SOLVER]) for q, _ in questions]
    batch = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    with torch.random.fork_rng(), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    right = sum(parse_boxed(text) == gold for text, (_, gold) in zip(texts, questions))
    return right / len(questions)
