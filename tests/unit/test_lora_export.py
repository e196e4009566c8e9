"""The merged export of a LoRA base (models.<m>.lora.export_merged): each adapter merged
into the base as a plain Hugging Face folder, which computes what the base with that
adapter active computes.

Expected values: the PeftModel with the adapter active (its logits), and by hand the
merged weight W + (alpha / r) B A of one adapted layer. The adapters are moved off their
start (B is zero there, where merging would change nothing) by seeded noise.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from drmas.config.model import LoraConfig, WarmStartConfig
from drmas.models.builtin import resolve_model_path
from drmas.models.lora import (
    ADAPTERS_FOLDER,
    MERGED_FOLDER,
    MERGED_MARKER,
    adapter_of_param,
    adapter_param_names,
    add_adapters,
    save_adapter_folder,
    write_merged,
    write_merged_folders,
)

LORA = LoraConfig(rank=4, alpha=8.0)
ADAPTERS = ["solver", "verifier"]
IDS = torch.tensor([[3, 17, 5, 29, 11, 2, 8], [9, 1, 33, 4, 21, 13, 6]])


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


def run_layout(model_path: Path, out: Path) -> torch.nn.Module:
    """out/ as a LoRA run exports it: the base's folder with adapters/<a>/ beside its
    weights, each adapter moved off its start; returns the PeftModel with them."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(model_path, out)
    peft_model = add_adapters(AutoModelForCausalLM.from_pretrained(out), LORA, ADAPTERS)
    params = dict(peft_model.named_parameters())
    by_adapter: dict[str, list[tuple[str, torch.Tensor]]] = {a: [] for a in ADAPTERS}
    with torch.no_grad():
        for i, name in enumerate(adapter_param_names(peft_model)):
            noise = torch.randn(params[name].shape, generator=torch.Generator().manual_seed(i))
            params[name].add_(0.2 * noise)
            by_adapter[adapter_of_param(name)].append((name, params[name].detach().clone()))
    for adapter, tensors in by_adapter.items():
        folder = out / ADAPTERS_FOLDER / adapter
        save_adapter_folder(peft_model, adapter, tensors, folder, str(out))
    return peft_model.eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_a_merged_folder_computes_what_its_adapter_does(model_path: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base_folder = tmp_path / "policy"
    peft_model = run_layout(model_path, base_folder)
    base = logits(AutoModelForCausalLM.from_pretrained(model_path).eval())
    out = write_merged(
        base_folder, base_folder / ADAPTERS_FOLDER / "verifier", tmp_path / "merged-verifier"
    )
    assert out == tmp_path / "merged-verifier"
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # no peft involved

    peft_model.set_adapter("verifier")
    expected = logits(peft_model)
    assert not torch.allclose(expected, base, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(logits(merged), expected, rtol=1e-5, atol=1e-5)
    peft_model.set_adapter("solver")
    assert not torch.allclose(logits(merged), logits(peft_model), atol=1e-3)

    # by hand, one adapted layer: W + (alpha / r) B A; an untargeted one unchanged
    params = dict(peft_model.named_parameters())
    prefix = "base_model.model.model.layers.1.self_attn.k_proj."
    w, a, b = (params[prefix + p].detach() for p in ("base_layer.weight", "lora_A.verifier.weight", "lora_B.verifier.weight"))  # fmt: skip
    weights = dict(merged.named_parameters())
    k_proj = weights["model.layers.1.self_attn.k_proj.weight"].detach()
    torch.testing.assert_close(k_proj, w + (LORA.alpha / LORA.rank) * b @ a)
    original = dict(AutoModelForCausalLM.from_pretrained(model_path).named_parameters())
    up = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(weights[up].detach(), original[up].detach())


def test_a_merged_folder_is_a_plain_hugging_face_folder(model_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    base_folder = tmp_path / "policy"
    run_layout(model_path, base_folder)
    written = write_merged_folders(base_folder, ADAPTERS)
    assert written == [base_folder / MERGED_FOLDER / a for a in ADAPTERS]
    for adapter, folder in zip(ADAPTERS, written, strict=True):
        files = sorted(p.name for p in folder.iterdir())
        assert files == sorted(
            [
                "config.json",
                "generation_config.json",
                "model.safetensors",
                "special_tokens_map.json",
                "tokenizer.json",
                "tokenizer_config.json",
                MERGED_MARKER,
            ]
        )
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            assert (folder / name).read_bytes() == (model_path / name).read_bytes()
        keys = load_file(str(folder / "model.safetensors")).keys()
        assert keys == load_file(str(model_path / "model.safetensors")).keys()  # no lora_*
        record = json.loads((folder / MERGED_MARKER).read_text())
        assert record == {
            "base": str(base_folder.resolve()),
            "adapter": str((base_folder / ADAPTERS_FOLDER / adapter).resolve()),
        }
    # written again: replaced, nothing left over
    write_merged_folders(base_folder, ADAPTERS[:1])
    assert sorted(p.name for p in (base_folder / MERGED_FOLDER).iterdir()) == ADAPTERS
    with pytest.raises(FileNotFoundError, match="no PEFT adapter folder"):
        write_merged(base_folder, tmp_path / "nowhere", tmp_path / "out")


@pytest.mark.parametrize("export_merged", [True, False])
def test_the_learners_export_writes_merged_folders_when_asked(
    model_path: Path, group: None, tmp_path: Path, export_merged: bool
) -> None:
    """The learner's final save (AdapterSet.save) writes merged/<a>/ for each adapter,
    each the base with the adapter it exported: the same logits as peft's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from drmas.config import load_config
    from drmas.learners.trainer import Trainer

    cfg = load_config(
        [
            f"models.solver.path={model_path}",
            "models.solver.lora.rank=4",
            f"models.solver.lora.export_merged={export_merged}",
            "agents.verifier.model=solver",
        ]
    )
    trainer = Trainer(cfg, "solver", 0, 1, "cpu")
    with torch.no_grad():
        for i, (name, param) in enumerate(trainer.model.named_parameters()):
            if "lora_" in name:
                local = param.to_local() if hasattr(param, "to_local") else param
                local.add_(0.2 * torch.randn(local.shape, generator=torch.Generator().manual_seed(i)))  # fmt: skip
    out = tmp_path / "models" / "solver"
    trainer.save_pretrained(out)
    if not export_merged:
        assert not (out / MERGED_FOLDER).exists()
        return
    assert sorted(p.name for p in (out / MERGED_FOLDER).iterdir()) == ADAPTERS
    for adapter in ADAPTERS:
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(out), out / ADAPTERS_FOLDER / adapter
        ).eval()
        merged = AutoModelForCausalLM.from_pretrained(out / MERGED_FOLDER / adapter).eval()
        torch.testing.assert_close(logits(merged), logits(peft_model), rtol=1e-5, atol=1e-5)
