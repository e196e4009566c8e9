"""LoRA adapters as engines serve them: PEFT folders, and which version serves each adapter.

Who uses it: the vllm engine (vllm_lora.py, its worker vllm_worker.py) and the sglang engine
(sglang_lora.py) turn each publish on a LoRA base into one PEFT folder per adapter
(`write_adapter_tensors` + `write_adapter_configs`: adapter_model.safetensors under peft's
saved names, and adapter_config.json), which their server loads by path, and digest what
they hold (`read_back_digest` over the folders of every adapter: equal to the learner's
digest of the version). `AdapterSlots` says which loaded version serves each adapter and
counts the requests running on every version, so that a superseded version is unloaded
only once no request uses it. Nothing here imports an engine's package.

A publish may carry only some of the adapters (those that changed since the version the
actor holds): only those get a new folder and a new loaded version; the others keep
theirs. `check_adapter_folder` refuses an adapter received in part.

`initial_adapter_tensors` gives every adapter as it starts, bit for bit the learner's
initial adapters (lora_A from `lora.init_seed`, lora_B = 0: the base model exactly), with
the names and shapes peft gives them: what an engine serves, and digests, for an adapter
no publish has carried yet.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas.models.lora import (
    adapter_of_param,
    adapter_param_names,
    add_adapters,
    peft_config,
    peft_saved_name,
)
from drmas.transports.digest import digest_of

if TYPE_CHECKING:
    from drmas.config.model import LoraConfig

TENSORS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def initial_adapter_tensors(
    model_path: Path, lora: LoraConfig, adapters: Sequence[str], dtype: torch.dtype = torch.float32
) -> list[tuple[str, torch.Tensor]]:
    """Every adapter's initial tensors (wire names, sorted, in `dtype`): bit for bit those
    the learner and the hf engine start from (drmas.models.lora.add_adapters: lora_A drawn
    from lora.init_seed, lora_B = 0), so an adapter no publish has carried yet digests as
    the learner's. Nothing is allocated for the base: the model is built on the meta device
    and each of its parameters replaced by a zero-stride CPU view (peft reads their device
    and dtype only), so peft creates and initialises the adapters on the CPU exactly as it
    does on a loaded base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            stub = torch.zeros((), dtype=torch.float32).expand(param.shape)
            module._parameters[name] = torch.nn.Parameter(stub, requires_grad=False)
    peft_model = add_adapters(model, lora, list(adapters))
    named = dict(peft_model.named_parameters())
    return [
        (name, named[name].detach().to(dtype, copy=True))
        for name in adapter_param_names(peft_model)
    ]


def names_by_adapter(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[str]]:
    """adapter -> the sorted wire names of its tensors (what a publish of it must carry)."""
    names: dict[str, list[str]] = {}
    for name, _ in named:
        names.setdefault(adapter_of_param(name), []).append(name)
    return {adapter: sorted(group) for adapter, group in names.items()}


def write_adapter_configs(folders: Mapping[str, Path], lora: LoraConfig, base_path: str) -> None:
    """adapter_config.json (peft's, for inference) in each adapter's folder (created if
    missing: a worker may have written the tensors first)."""
    config = peft_config(lora)
    config.inference_mode = True
    config.base_model_name_or_path = base_path
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(str(folder))


def write_adapter_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], folders: Mapping[str, Path]
) -> dict[str, int]:
    """Write each received adapter's tensors (wire names: PeftModel.named_parameters()) into
    its folder's adapter_model.safetensors (the folder created if missing) under peft's saved
    names; returns how many tensors each received adapter got. An adapter of `folders` that
    got none is not in the publish (it did not change): nothing is written for it. A tensor
    of an adapter without a folder is a ValueError, and nothing is written."""
    from safetensors.torch import save_file

    states: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        adapter = adapter_of_param(name)
        if adapter not in folders:
            raise ValueError(
                f"received {name!r} of adapter {adapter!r}; this engine serves "
                f"{sorted(folders)} (do the learner and the actor run the same config?)"
            )
        saved = peft_saved_name(name, adapter)
        states.setdefault(adapter, {})[saved] = tensor.detach().to("cpu").contiguous()
    for adapter, state in states.items():
        folders[adapter].mkdir(parents=True, exist_ok=True)
        save_file(state, str(folders[adapter] / TENSORS_FILE), metadata={"format": "pt"})
    return {adapter: len(state) for adapter, state in sorted(states.items())}


def check_adapter_folder(folder: Path, adapter: str, expected: Sequence[str]) -> None:
    """ValueError unless the folder's adapter_model.safetensors holds exactly the tensors
    `expected` (wire names of `adapter`, safe_open reads only the file's header): a publish
    carries an adapter whole or not at all, and a folder missing some tensors is not the
    adapter the learner holds."""
    from safetensors import safe_open

    with safe_open(str(folder / TENSORS_FILE), framework="pt") as f:
        got = {wire_name(saved, adapter) for saved in f.keys()}  # noqa: SIM118
    missing, unknown = sorted(set(expected) - got), sorted(got - set(expected))
    if missing or unknown:
        raise ValueError(
            f"the publish carried adapter {adapter!r} in part: {len(missing)} of its tensors "
            f"missing (e.g. {missing[:1]}), {len(unknown)} unknown (e.g. {unknown[:1]}); "
            "do the learner and the actor run the same config?"
        )


def wire_name(saved: str, adapter: str) -> str:
    """Inverse of peft_saved_name: `...q_proj.lora_A.weight` -> `...q_proj.lora_A.<adapter>.weight`."""
    parts = saved.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return ".".join([*parts[: i + 1], adapter, *parts[i + 1 :]])
    raise ValueError(f"{saved!r} is not a LoRA adapter tensor name (no lora_* segment)")


def read_back(folders: Mapping[str, Path]) -> list[tuple[str, torch.Tensor]]:
    """The adapter tensors as written to the folders (adapter -> folder), under their wire
    names."""
    from safetensors.torch import load_file

    pieces: list[tuple[str, torch.Tensor]] = []
    for adapter, folder in folders.items():
        for saved, tensor in load_file(str(folder / TENSORS_FILE)).items():
            pieces.append((wire_name(saved, adapter), tensor))
    return pieces


def read_back_digest(folders: Mapping[str, Path]) -> str:
    """drmas digest of the adapter tensors as written to the folders the server loaded,
    under their wire names: over the folder of every adapter an engine serves, equal to the
    learner's digest of that version."""
    return digest_of(read_back(folders))


class AdapterSlots:
    """Which loaded version serves each adapter now, and how many running requests hold
    each one (current or superseded). A version is whatever the engine loaded it as (vLLM's
    LoRARequest, sglang_lora.Loaded): anything with a unique `lora_int_id`."""

    def __init__(self, adapters: Sequence[str]) -> None:
        self.adapters = list(adapters)
        self.current: dict[str, Any] = {}
        """adapter -> LoRARequest of the latest version (none before the first publish)."""
        self.users: Counter[int] = Counter()
        self.superseded: dict[int, Any] = {}
        """lora_int_id -> LoRARequest replaced by a newer version but still in use."""
        self.base: Any = None
        """LoRARequest that serves requests for the base ("") on CPU (BASE_SLOT); None:
        those run without one."""

    def check(self, adapter: str) -> None:
        """ValueError unless `adapter` is "" (the base) or one this engine serves."""
        if adapter and adapter not in self.adapters:
            raise ValueError(
                f"request for LoRA adapter {adapter!r}; this engine serves {self.adapters} "
                "(or '' for the base model)"
            )

    def acquire(self, adapter: str) -> Any:
        """The LoRARequest to run a request for `adapter` with (None: the base model),
        counted as in use until `release`."""
        self.check(adapter)
        request = self.current.get(adapter) if adapter else self.base
        if request is not None:
            self.users[request.lora_int_id] += 1
        return request

    def release(self, request: Any) -> Any:
        """One request on `request` ended; returns it when it was superseded and nobody
        uses it any more (the caller removes it from vLLM), else None."""
        if request is None:
            return None
        self.users[request.lora_int_id] -= 1
        if self.users[request.lora_int_id] > 0:
            return None
        del self.users[request.lora_int_id]
        return self.superseded.pop(request.lora_int_id, None)

    def switch(self, new: Mapping[str, Any]) -> list[Any]:
        """Serve `new` (adapter -> loaded version: the adapters a publish carried) from now
        on; every other adapter keeps the version it has. Returns the replaced versions
        nobody uses (to remove)."""
        unknown = sorted(set(new) - set(self.adapters))
        if unknown:
            raise ValueError(f"new adapters {unknown} are not among {self.adapters}")
        unused = []
        for adapter in new:
            old = self.current.get(adapter)
            if old is None:
                continue
            if self.users[old.lora_int_id] > 0:
                self.superseded[old.lora_int_id] = old
            else:
                unused.append(old)
        self.current.update(new)
        return unused
