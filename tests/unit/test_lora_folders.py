"""PEFT folders for the engines' LoRA adapters, without any engine
(drmas/actors/engines/lora_folders.py): what a publish becomes on disk (peft itself loads
it back as the adapters that were sent), the digest read back from it, the all-zero
initial adapters, and the names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drmas.actors.engines import lora_folders as lf
from drmas.models.lora import peft_saved_name
from drmas.transports.digest import digest_of
from tests.unit.lora_helpers import ADAPTERS, LORA, peft_model, published, tiny_model_folder


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_folder(tmp_path_factory.mktemp("qwen2"))


def test_published_adapters_become_peft_folders_peft_loads(
    model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    learner = peft_model(model_path)
    sent = published(learner)
    folders = {a: tmp_path / a for a in ADAPTERS}
    lf.write_adapter_configs(folders, LORA, str(model_path))
    assert lf.write_adapter_tensors(sent, folders) == len(sent)
    config = json.loads((folders["solver"] / lf.CONFIG_FILE).read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    assert sorted(config["target_modules"]) == sorted(LORA.target_modules)
    assert lf.read_back_digest(folders) == digest_of(sent)  # what the learner digests
    # peft reads each folder back as exactly the adapter that was sent
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    loaded = PeftModel.from_pretrained(base, str(folders["solver"]), adapter_name="solver")
    loaded.load_adapter(str(folders["verifier"]), adapter_name="verifier")
    params = dict(loaded.named_parameters())
    for name, tensor in sent:
        assert torch.equal(params[name], tensor), name


def test_a_publish_that_does_not_fit_the_adapters_is_refused(
    model_path: Path, tmp_path: Path
) -> None:
    sent = published(peft_model(model_path))
    folders = {a: tmp_path / a for a in ADAPTERS}
    lf.write_adapter_configs(folders, LORA, "")
    critic = [(n.replace(".verifier.", ".critic."), t) for n, t in sent]
    with pytest.raises(ValueError, match=r"adapter 'critic'; this engine serves"):
        lf.write_adapter_tensors(critic, folders)
    only_solver = [(n, t) for n, t in sent if ".solver." in n]
    with pytest.raises(ValueError, match=r"no tensors of adapter\(s\) \['verifier'\]"):
        lf.write_adapter_tensors(only_solver, folders)


def test_wire_name_inverts_peft_saved_name() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.solver.weight"
    assert lf.wire_name(peft_saved_name(name, "solver"), "solver") == name
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        lf.wire_name("model.norm.weight", "solver")


def test_initial_adapters_are_zero_with_the_learners_names_and_shapes(model_path: Path) -> None:
    zeros = lf.initial_adapter_tensors(model_path, LORA, ADAPTERS)
    learner = dict(published(peft_model(model_path)))
    assert sorted(n for n, _ in zeros) == sorted(learner)
    for name, tensor in zeros:
        assert tensor.shape == learner[name].shape and not tensor.any()
