"""PEFT folders for the engines' LoRA adapters, without any engine
(drmas/actors/engines/lora_folders.py): what a publish becomes on disk (peft itself loads
it back as the adapters that were sent), a publish of some of the adapters, the digest
read back, the initial adapters (the learner's, bit for bit), the names, and which version
serves each adapter.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from drmas.actors.engines import lora_folders as lf
from drmas.models.lora import add_adapters, is_adapter_param, peft_saved_name
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
    assert lf.write_adapter_tensors(sent, folders) == {
        "solver": len(sent) // 2,
        "verifier": len(sent) // 2,
    }
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


def test_a_publish_of_some_adapters_writes_only_theirs(model_path: Path, tmp_path: Path) -> None:
    """A publish carrying the solver only: the solver's folder holds its tensors, the
    verifier gets no folder; a tensor of an adapter the engine does not serve is refused
    before anything is written."""
    sent = published(peft_model(model_path))
    solver = [(n, t) for n, t in sent if ".solver." in n]
    folders = {a: tmp_path / a for a in ADAPTERS}
    assert lf.write_adapter_tensors(solver, folders) == {"solver": len(solver)}
    assert not folders["verifier"].exists()
    assert lf.read_back_digest({"solver": folders["solver"]}) == digest_of(solver)
    assert lf.write_adapter_tensors([], folders) == {}
    critic = [(n.replace(".verifier.", ".critic."), t) for n, t in sent]
    with pytest.raises(ValueError, match=r"adapter 'critic'; this engine serves"):
        lf.write_adapter_tensors(critic, {"solver": tmp_path / "s2", "verifier": tmp_path / "v2"})
    assert not (tmp_path / "s2").exists()


def test_an_adapter_received_in_part_is_refused(model_path: Path, tmp_path: Path) -> None:
    names = lf.names_by_adapter(published(peft_model(model_path)))
    assert sorted(names) == ADAPTERS and len(names["solver"]) == 2 * 4 * 2  # 2 layers, q k v o, A B
    sent = dict(published(peft_model(model_path)))
    folder = tmp_path / "solver"
    lf.write_adapter_tensors([(n, sent[n]) for n in names["solver"]], {"solver": folder})
    lf.check_adapter_folder(folder, "solver", names["solver"])  # whole: fine
    lf.write_adapter_tensors([(n, sent[n]) for n in names["solver"][1:]], {"solver": folder})
    with pytest.raises(ValueError, match=r"'solver' in part: 1 of its tensors missing"):
        lf.check_adapter_folder(folder, "solver", names["solver"])
    with pytest.raises(ValueError, match=r"0 of its tensors missing .* 1 unknown"):
        lf.check_adapter_folder(folder, "solver", names["solver"][1:-1])


def test_wire_name_inverts_peft_saved_name() -> None:
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.solver.weight"
    assert lf.wire_name(peft_saved_name(name, "solver"), "solver") == name
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        lf.wire_name("model.norm.weight", "solver")


def test_initial_adapters_are_the_learners_bit_for_bit(model_path: Path) -> None:
    """The learner's initial adapters from an independent build: add_adapters on a real
    (randomly initialised) base under another global seed; lora_B zero, lora_A not; in the
    engine's dtype, the cast of those."""
    from transformers import AutoConfig, AutoModelForCausalLM

    initial = lf.initial_adapter_tensors(model_path, LORA, ADAPTERS)
    torch.manual_seed(99)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    learner = add_adapters(base, LORA, ADAPTERS)
    expected = [(n, p.detach()) for n, p in learner.named_parameters() if is_adapter_param(n)]
    assert [n for n, _ in initial] == sorted(n for n, _ in expected)
    assert lf.names_by_adapter(initial) == lf.names_by_adapter(expected)
    assert digest_of(initial) == digest_of(expected)
    for name, tensor in initial:
        assert tensor.dtype == torch.float32 and tensor.any() == ("lora_A" in name), name
    bf16 = lf.initial_adapter_tensors(model_path, LORA, ADAPTERS, torch.bfloat16)
    assert digest_of(bf16) == digest_of((n, t.to(torch.bfloat16)) for n, t in expected)


@dataclass(frozen=True)
class Version:
    lora_int_id: int


def test_switching_some_adapters_keeps_the_others_version() -> None:
    slots = lf.AdapterSlots(ADAPTERS)
    assert slots.switch({"solver": Version(1), "verifier": Version(2)}) == []
    verifier = slots.current["verifier"]
    assert slots.acquire("solver") == Version(1)  # a request runs on solver v1
    assert slots.switch({"solver": Version(3)}) == []  # v1 in use: superseded, not removed
    assert slots.current == {"solver": Version(3), "verifier": Version(2)}
    assert slots.current["verifier"] is verifier and slots.superseded == {1: Version(1)}
    assert slots.release(Version(1)) == Version(1)  # its last request ended: remove it now
    assert slots.switch({}) == [] and slots.current["verifier"] is verifier
    assert slots.switch({"verifier": Version(4)}) == [Version(2)]
    with pytest.raises(ValueError, match=r"new adapters \['critic'\] are not among"):
        slots.switch({"critic": Version(5)})
