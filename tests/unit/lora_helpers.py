"""Shared by the engines' LoRA unit tests (test_lora_folders, test_vllm_lora, test_sglang_lora,
test_sglang_contract, test_sglang_engine): a Qwen2 config small enough to build in
milliseconds, and the learner's side of a publish (peft adapters with lora_B non-zero,
sent under their wire names)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drmas.config.model import LoraConfig
from drmas.models.lora import adapter_param_names, add_adapters

ADAPTERS = ["solver", "verifier"]
LORA = LoraConfig(rank=4, alpha=8.0)


def tiny_model_folder(folder: Path) -> Path:
    """A two-layer Qwen2's config.json in `folder` (no weights: nothing here loads them)."""
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def peft_model(model_path: Path, seed: int = 0) -> Any:
    """The learner's side: the base with both adapters, lora_B drawn from `seed`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(123)
    model = add_adapters(
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)), LORA, ADAPTERS
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def published(model: Any) -> list[tuple[str, torch.Tensor]]:
    """A publish on a LoRA base: every adapter tensor, sorted by wire name."""
    params = dict(model.named_parameters())
    return [(n, params[n].detach().clone()) for n in adapter_param_names(model)]
