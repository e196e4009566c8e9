"""LoRA adapters as engines serve them: PEFT folders, and which version serves each adapter.

Who uses it: the vllm engine (vllm_lora.py, its worker vllm_worker.py) and the sglang engine
(sglang_lora.py) turn each publish on a LoRA base into one PEFT folder per adapter
(`write_adapter_configs` + `write_adapter_tensors`: adapter_config.json and
adapter_model.safetensors under peft's saved names), which their server loads by path, and
digest what they wrote (`read_back_digest`: equal to the learner's digest of the publish).
`AdapterSlots` says which loaded version serves each adapter and counts the requests
running on every version, so that a superseded version is unloaded only once no request
uses it. Nothing here imports an engine's package.

`initial_adapter_tensors` gives every adapter as it starts, all zeros (the base model
exactly, as the learner's initial adapters are: lora_B = 0), with the names and shapes
peft gives them, for engines that must serve adapters before the first publish.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drmas.models.lora import (
    adapter_of_param,
    add_adapters,
    is_adapter_param,
    peft_config,
    peft_saved_name,
)
from drmas.transports.digest import digest_of

if TYPE_CHECKING:
    from drmas.config.model import LoraConfig

TENSORS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def initial_adapter_tensors(
    model_path: Path, lora: LoraConfig, adapters: Sequence[str]
) -> list[tuple[str, torch.Tensor]]:
    """Every adapter's tensors (wire names), all zero: the base model exactly, as every
    adapter starts. Names and shapes come from peft on a meta-device copy of the model
    (nothing is loaded or allocated for the base)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    peft_model = add_adapters(model, lora, list(adapters))
    return [
        (name, torch.zeros(param.shape, dtype=torch.float32))
        for name, param in peft_model.named_parameters()
        if is_adapter_param(name)
    ]


def write_adapter_configs(folders: dict[str, Path], lora: LoraConfig, base_path: str) -> None:
    """adapter_config.json (peft's, for inference) in each adapter's folder, created here."""
    config = peft_config(lora)
    config.inference_mode = True
    config.base_model_name_or_path = base_path
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=False)
        config.save_pretrained(str(folder))


def write_adapter_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]], folders: dict[str, Path]
) -> int:
    """Write each adapter's tensors (wire names: PeftModel.named_parameters()) into its
    folder's adapter_model.safetensors under peft's saved names; returns how many. A tensor
    of an adapter without a folder, or an adapter that got none, is a ValueError."""
    from safetensors.torch import save_file

    states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in folders}
    count = 0
    for name, tensor in named_tensors:
        adapter = adapter_of_param(name)
        if adapter not in states:
            raise ValueError(
                f"received {name!r} of adapter {adapter!r}; this engine serves "
                f"{sorted(states)} (do the learner and the actor run the same config?)"
            )
        states[adapter][peft_saved_name(name, adapter)] = tensor.detach().to("cpu").contiguous()
        count += 1
    empty = sorted(a for a, state in states.items() if not state)
    if empty:
        raise ValueError(f"the publish carried no tensors of adapter(s) {empty}")
    for adapter, state in states.items():
        save_file(state, str(folders[adapter] / TENSORS_FILE), metadata={"format": "pt"})
    return count


def wire_name(saved: str, adapter: str) -> str:
    """Inverse of peft_saved_name: `...q_proj.lora_A.weight` -> `...q_proj.lora_A.<adapter>.weight`."""
    parts = saved.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return ".".join([*parts[: i + 1], adapter, *parts[i + 1 :]])
    raise ValueError(f"{saved!r} is not a LoRA adapter tensor name (no lora_* segment)")


def read_back_digest(folders: dict[str, Path]) -> str:
    """drmas digest of the adapter tensors as written to the folders vLLM loads, under
    their wire names: equal to the learner's digest of the publish."""
    from safetensors.torch import load_file

    pieces: list[tuple[str, torch.Tensor]] = []
    for adapter, folder in folders.items():
        for saved, tensor in load_file(str(folder / TENSORS_FILE)).items():
            pieces.append((wire_name(saved, adapter), tensor))
    return digest_of(pieces)


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

    def switch(self, new: dict[str, Any]) -> list[Any]:
        """Serve `new` from now on; returns the replaced requests nobody uses (to remove)."""
        if sorted(new) != sorted(self.adapters):
            raise ValueError(f"new adapters {sorted(new)} differ from {sorted(self.adapters)}")
        unused = []
        for old in self.current.values():
            if self.users[old.lora_int_id] > 0:
                self.superseded[old.lora_int_id] = old
            else:
                unused.append(old)
        self.current = dict(new)
        return unused
