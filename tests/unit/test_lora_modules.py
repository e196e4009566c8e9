"""drmas/models/lora.py: the adapters learners and engines build must be identical, named
as the wire and peft's files expect, and train one at a time.

A tiny in-memory Qwen2 (2 layers, q/v adapters) stands in for a base model; peft's own
save_pretrained and PeftModel.from_pretrained are the independent references for names
and folders.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM

from drmas.config.model import LoraConfig
from drmas.models.lora import (
    activate_adapter,
    adapter_of_param,
    adapter_param_names,
    add_adapters,
    check_adapter_names,
    peft_saved_name,
    save_adapter_folder,
)

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], init_seed=3)
ADAPTERS = ["solver", "verifier"]
LAYERS = 2


def tiny_base(dtype: torch.dtype = torch.float32) -> Qwen2ForCausalLM:
    """The same random base every call (its own seed, not the adapters')."""
    config = Qwen2Config(
        vocab_size=40,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = Qwen2ForCausalLM(config)
    return model.to(dtype)


def test_adapters_are_named_frozen_and_trainable_as_the_contract_says() -> None:
    model = add_adapters(tiny_base(), LORA, ADAPTERS)
    names = adapter_param_names(model)
    # 2 layers x 2 target modules x (A, B) x 2 adapters
    assert len(names) == LAYERS * 2 * 2 * 2
    assert names == sorted(names)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.solver.weight" in names
    assert "base_model.model.model.layers.1.self_attn.v_proj.lora_B.verifier.weight" in names
    for name, param in model.named_parameters():
        assert param.requires_grad == (name in names), name
    assert model.active_adapter == "solver"


def test_two_builds_are_bit_identical_and_leave_the_callers_rng_alone() -> None:
    torch.manual_seed(99)
    expected_next = torch.rand(3)
    torch.manual_seed(99)
    first = dict(add_adapters(tiny_base(), LORA, ADAPTERS).named_parameters())
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream did not move
    torch.manual_seed(7)  # another caller state: the adapters must not depend on it
    second = dict(add_adapters(tiny_base(), LORA, ADAPTERS).named_parameters())
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    a_solver = first["base_model.model.model.layers.0.self_attn.q_proj.lora_A.solver.weight"]
    a_verifier = first["base_model.model.model.layers.0.self_attn.q_proj.lora_A.verifier.weight"]
    assert not torch.equal(a_solver, a_verifier)  # each adapter draws its own A
    other_seed = LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"], init_seed=4)
    third = dict(add_adapters(tiny_base(), other_seed, ADAPTERS).named_parameters())
    assert not torch.equal(
        third["base_model.model.model.layers.0.self_attn.q_proj.lora_A.solver.weight"], a_solver
    )


def test_every_adapter_starts_as_the_base_model() -> None:
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        base_logits = tiny_base()(input_ids=ids).logits
        model = add_adapters(tiny_base(), LORA, ADAPTERS)
        for name in adapter_param_names(model):
            if ".lora_B." in name:
                assert not dict(model.named_parameters())[name].any(), name
        for adapter in ADAPTERS:
            model.set_adapter(adapter)
            assert torch.equal(model(input_ids=ids).logits, base_logits)


def test_bf16_base_keeps_fp32_adapters() -> None:
    model = add_adapters(tiny_base(torch.bfloat16), LORA, ADAPTERS)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    for name in adapter_param_names(model):
        assert dtypes[name] == torch.float32, name
    assert dtypes["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"] == (
        torch.bfloat16
    )


def test_names_of_an_adapter_parameter() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.solver.weight"
    assert adapter_of_param(name) == "solver"
    assert peft_saved_name(name, "solver") == (
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    # an adapter named like a module segment is still found by its position
    tricky = "base_model.model.model.layers.3.self_attn.v_proj.lora_B.model.weight"
    assert adapter_of_param(tricky) == "model"
    assert peft_saved_name(tricky, "model") == (
        "base_model.model.model.layers.3.self_attn.v_proj.lora_B.weight"
    )
    with pytest.raises(ValueError, match="not a LoRA adapter parameter"):
        adapter_of_param("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ValueError, match="belongs to adapter 'solver'"):
        peft_saved_name(name, "verifier")


def test_saved_names_match_peft_own_save(tmp_path: Path) -> None:
    model = add_adapters(tiny_base(), LORA, ADAPTERS)
    model.save_pretrained(str(tmp_path), selected_adapters=["verifier"])
    peft_keys = set(load_file(tmp_path / "verifier" / "adapter_model.safetensors"))
    ours = {
        peft_saved_name(n, "verifier")
        for n in adapter_param_names(model)
        if adapter_of_param(n) == "verifier"
    }
    assert ours == peft_keys


def test_only_the_active_adapter_gets_a_gradient() -> None:
    model = add_adapters(tiny_base(), LORA, ADAPTERS)
    activate_adapter(model, "verifier")
    params = dict(model.named_parameters())
    for name in adapter_param_names(model):
        assert params[name].requires_grad, name  # peft's set_adapter had cleared "solver"
    model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
    for name in adapter_param_names(model):
        grad = params[name].grad
        if adapter_of_param(name) == "verifier":
            assert grad is not None, name
        else:
            assert grad is None, name
    assert all(p.grad is None for n, p in params.items() if not p.requires_grad)


def test_a_saved_adapter_folder_loads_with_peft(tmp_path: Path) -> None:
    from peft import PeftModel

    model = add_adapters(tiny_base(), LORA, ADAPTERS)
    params = dict(model.named_parameters())
    with torch.no_grad():  # a trained-looking adapter: B no longer zero
        for name in adapter_param_names(model):
            params[name].add_(0.01 * torch.arange(params[name].numel()).view_as(params[name]))
    base_dir = tmp_path / "base"
    tiny_base().save_pretrained(base_dir)
    tensors = [
        (n, params[n]) for n in adapter_param_names(model) if adapter_of_param(n) == "verifier"
    ]
    out = tmp_path / "adapters" / "verifier"
    save_adapter_folder(model, "verifier", tensors, out, str(base_dir))
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}

    loaded = PeftModel.from_pretrained(Qwen2ForCausalLM.from_pretrained(base_dir), str(out))
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    model.set_adapter("verifier")
    model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    loaded_params = dict(loaded.named_parameters())
    for name, tensor in tensors:
        assert torch.equal(loaded_params[name.replace(".verifier.", ".default.")], tensor)


@pytest.mark.parametrize(
    ("names", "match"),
    [([], "at least one"), (["a", "a"], "repeat"), (["x.y"], "without '.'"), ([""], "non-empty")],
)
def test_bad_adapter_names_are_refused(names: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_adapter_names(names)
