"""Builtin models: real Hugging Face checkpoint folders built on first use and cached.

`builtin:tiny-qwen2` is a character-level Qwen2 (~0.8 M parameters) that runs the whole
system on a laptop CPU. An untrained model never writes a parseable `\\boxed{}` answer, so
RL would see reward 0 everywhere and learn nothing; the warm start (warmstart.py) teaches
it one team's plain transcript format: the math team's on generated arithmetic
(math_transcripts.py) or the search team's on a synthetic knowledge base
(search_transcripts.py), chosen by `WarmStartConfig.workflow`.

The folder is an ordinary checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json), so every engine and learner
loads it with `from_pretrained` like any other model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.actors.workflows.math_prompts import SOLVER, VERIFIER, plain_prompt, solver_response
from drmas.filelock import file_lock
from drmas.models import math_transcripts, search_transcripts
from drmas.models.config import WarmStartConfig

# Re-exported: tests and benchmarks import the math warm start's pieces from here.
from drmas.models.math_transcripts import (  # noqa: F401
    ARITHMETIC,
    ArithmeticSpec,
    arithmetic_question,
    solver_accuracy,
    transcript,
)
from drmas.models.warmstart import (  # noqa: F401
    TranscriptSource,
    response_loss,
    transcript_batch,
    warm_start,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

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

WARM_STARTS: dict[str, TranscriptSource] = {
    "math": math_transcripts.SOURCE,
    "search": search_transcripts.SOURCE,
}
"""WarmStartConfig.workflow -> the team whose transcripts the warm start trains on."""


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
        "transcripts": asdict(WARM_STARTS[warmstart.workflow].spec),
        "instructions": WARM_STARTS[warmstart.workflow].instructions,
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
    with file_lock(root / f"{final.name}.lock"):
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
    source = WARM_STARTS[warmstart.workflow]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(source.seed)
            model = Qwen2ForCausalLM(config).float()
            if warmstart.steps > 0:
                warm_start(model, tokenizer, warmstart, source)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)


BUILTINS = {"tiny-qwen2": build_tiny_qwen2, "small-qwen2": build_small_qwen2}
