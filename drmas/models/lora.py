"""LoRA adapters per agent on a frozen base: the one way learners and engines build them.

A model with `models.<m>.lora.rank > 0` is a frozen base; each of its adapters
(DrmasConfig.adapters_of) trains on its agents' steps. The learner
(drmas/learners/trainer.py) and every hf engine (drmas/actors/engines/hf.py) call
`add_adapters` with the same LoraConfig and adapter list: the same seed and the same
order give bit-identical initial adapters on both sides (lora_B starts at zero, so every
adapter starts as the base model), before any weights are published.

Names: a publish on a LoRA base carries only the adapter tensors, under the names
`PeftModel.named_parameters()` gives them (`adapter_param_names`, sorted), e.g.
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.solver.weight`.
`adapter_of_param` reads the adapter back from such a name; `peft_saved_name` is the name
peft's adapter_model.safetensors uses for it (the adapter segment removed), for writing
an adapter folder that `peft.PeftModel.from_pretrained` (and vLLM) load.

Folders: the end of a run writes RUN_DIR/models/<model>/ (the base) and
RUN_DIR/models/<model>/adapters/<adapter>/ (`save_adapter_folder`, called by
drmas/learners/adapters.py); with `models.<m>.lora.export_merged` also
RUN_DIR/models/<model>/merged/<adapter>/ (`write_merged_folders`): the base with that
adapter merged in, a plain Hugging Face folder for tools without peft. `drmas eval --step`
writes a learner checkpoint's adapters as PEFT folders with `write_adapter_folder`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftConfig, PeftModel
    from transformers import PreTrainedModel

    from drmas.config.model import LoraConfig

log = logging.getLogger("drmas.models")

ADAPTERS_FOLDER = "adapters"
"""A LoRA run exports RUN_DIR/models/<model>/ (the base, an HF folder) and
RUN_DIR/models/<model>/adapters/<adapter>/ (one PEFT folder per adapter)."""
MERGED_FOLDER = "merged"
"""With lora.export_merged, RUN_DIR/models/<model>/merged/<adapter>/: base + adapter merged."""
MERGED_MARKER = "drmas_merged.json"
"""A merged folder's record of its base and adapter; drmas eval reads it to refuse putting
the adapters of a LoRA base on top of a model that already holds one."""
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_WRITTEN_BY_SAVE = ("config.json", "generation_config.json", MERGED_MARKER)
BASE_ADAPTER = "__base__"
"""The name peft's mixed-batch inference (`adapter_names=`) uses for the base model."""
_LORA_PREFIX = "lora_"


def add_adapters(model: PreTrainedModel, lora: LoraConfig, adapters: list[str]) -> PeftModel:
    """`model` wrapped as a PeftModel with one LoRA adapter per name of `adapters`, created
    in that order from `lora.init_seed` (the caller's RNG streams are left as they were).
    The base is frozen; every adapter parameter requires grad; adapters[0] is active."""
    from peft import get_peft_model

    check_adapter_names(adapters)
    config = peft_config(lora)
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(lora.init_seed)
        peft_model = get_peft_model(model, config, adapter_name=adapters[0])
        for name in adapters[1:]:
            peft_model.add_adapter(name, copy.deepcopy(config))
    for name, param in peft_model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    return peft_model


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    """peft's LoraConfig for drmas' models.<m>.lora (causal LM, no bias terms)."""
    from peft import LoraConfig as PeftConfig
    from peft import TaskType

    return PeftConfig(
        r=lora.rank,
        # peft types lora_alpha as int; its scaling alpha / r takes any number
        lora_alpha=lora.alpha,  # type: ignore[arg-type]
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type=TaskType.CAUSAL_LM,
    )


def check_adapter_names(adapters: list[str]) -> None:
    """Adapter names become one segment of parameter names: non-empty, unique, no dots."""
    if not adapters:
        raise ValueError("a LoRA base needs at least one adapter (an agent bound to it)")
    if len(set(adapters)) != len(adapters):
        raise ValueError(f"adapter names {adapters} repeat; each must be unique")
    for name in adapters:
        if not name or "." in name or name == BASE_ADAPTER:
            raise ValueError(
                f"adapter name {name!r} cannot name a LoRA adapter (it must be non-empty, "
                f"without '.', and not {BASE_ADAPTER!r}); set agents.<a>.adapter to another name"
            )


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (as a PeftModel names it) is an adapter's."""
    return any(part.startswith(_LORA_PREFIX) for part in name.split("."))


def adapter_param_names(peft_model: torch.nn.Module) -> list[str]:
    """Sorted names of every adapter parameter, as `named_parameters()` gives them."""
    return sorted(n for n, _ in peft_model.named_parameters() if is_adapter_param(n))


def _adapter_index(name: str) -> tuple[list[str], int]:
    """(segments of name, index of its adapter segment: the one after `lora_A`/`lora_B`)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith(_LORA_PREFIX):
            return parts, i + 1
    raise ValueError(f"{name!r} is not a LoRA adapter parameter (no lora_* segment)")


def adapter_of_param(name: str) -> str:
    """The adapter a parameter belongs to: `...q_proj.lora_A.solver.weight` -> "solver"."""
    parts, i = _adapter_index(name)
    return parts[i]


def peft_saved_name(name: str, adapter: str) -> str:
    """The key of `name` in peft's adapter_model.safetensors: its `.{adapter}` segment
    removed (`...q_proj.lora_A.solver.weight` -> `...q_proj.lora_A.weight`)."""
    parts, i = _adapter_index(name)
    if parts[i] != adapter:
        raise ValueError(f"{name!r} belongs to adapter {parts[i]!r}, not {adapter!r}")
    return ".".join(parts[:i] + parts[i + 1 :])


def name_from_saved(saved: str, adapter: str) -> str:
    """The inverse of peft_saved_name: a key of adapter_model.safetensors as the parameter
    name of `adapter` (`...q_proj.lora_A.weight` -> `...q_proj.lora_A.solver.weight`)."""
    parts = saved.split(".")
    at = [i for i, part in enumerate(parts) if part.startswith(_LORA_PREFIX)]
    if len(at) != 1:
        raise ValueError(f"{saved!r} is not one LoRA parameter of a PEFT adapter file")
    return ".".join([*parts[: at[0] + 1], adapter, *parts[at[0] + 1 :]])


def activate_adapter(peft_model: PeftModel, adapter: str) -> None:
    """Make `adapter` the one forward passes use. Every adapter keeps requires_grad True
    (peft's set_adapter clears it on the others): an inactive adapter is not in the
    graph, so it gets no gradient (None) and AdamW leaves it exactly as it was."""
    peft_model.set_adapter(adapter)
    for name, param in peft_model.named_parameters():
        if is_adapter_param(name):
            param.requires_grad_(True)


@contextlib.contextmanager
def adapters_off(peft_model: PeftModel, active: str) -> Iterator[None]:
    """Forward passes inside run the frozen base alone (every adapter switched off, its
    weights untouched): the KL term's reference on a LoRA base, with no second copy of the
    base. On leaving, `active` is the adapter in use again and every adapter keeps
    requires_grad (`activate_adapter`)."""
    tuner: Any = peft_model.base_model  # peft's LoraModel
    tuner.disable_adapter_layers()
    try:
        yield
    finally:
        tuner.enable_adapter_layers()
        activate_adapter(peft_model, active)


def save_adapter_folder(
    peft_model: PeftModel,
    adapter: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    out: Path,
    base_path: str = "",
) -> None:
    """Write one adapter as a PEFT folder (adapter_config.json, adapter_model.safetensors)
    that `peft.PeftModel.from_pretrained(base, out)` loads. `tensors`: (name as
    named_parameters() gives it, full tensor) of this adapter's parameters."""
    write_adapter_folder(peft_model.peft_config[adapter], adapter, tensors, out, base_path)


def write_adapter_folder(
    config: PeftConfig,
    adapter: str,
    tensors: Iterable[tuple[str, torch.Tensor]],
    out: Path,
    base_path: str = "",
) -> None:
    """save_adapter_folder without a PeftModel: `config` is the adapter's peft LoraConfig
    (peft_model.peft_config[adapter], or `peft_config(lora)`); it is not modified."""
    from safetensors.torch import save_file

    state = {peft_saved_name(n, adapter): t.detach().contiguous() for n, t in tensors}
    if not state:
        raise ValueError(f"no tensors of adapter {adapter!r} to save")
    config = copy.deepcopy(config)
    config.inference_mode = True
    config.base_model_name_or_path = base_path or None
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------ merged export
def write_merged_folders(base_folder: Path, adapters: list[str]) -> list[Path]:
    """base_folder/merged/<adapter>/ for each adapter of base_folder/adapters/<adapter>/
    (the layout a LoRA run exports: `write_merged` of each); returns the folders. Loads
    the base once per adapter: a merge changes the base's weights in place."""
    written = []
    for adapter in adapters:
        folder = base_folder / MERGED_FOLDER / adapter
        written.append(write_merged(base_folder, base_folder / ADAPTERS_FOLDER / adapter, folder))
        log.info("wrote %s: %s with adapter %s merged in", folder, base_folder, adapter)
    return written


def write_merged(base_folder: Path, adapter_folder: Path, out: Path) -> Path:
    """The base at `base_folder` (an HF folder) with the PEFT adapter at `adapter_folder`
    merged into its weights (W + (alpha / r) B A: peft's merge_and_unload, computed in
    fp32) as a plain HF folder at `out`, which AutoModelForCausalLM, vLLM and SGLang load
    without peft: config, weights in the base's dtype, generation config, the base folder's
    tokenizer files, and MERGED_MARKER (which base, which adapter). Written to a temporary
    folder and renamed, so `out` is complete or absent; an existing `out` is replaced."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not (adapter_folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_folder}: no PEFT adapter folder (adapter_config.json)")
    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype="auto")
    dtype = base.dtype
    merged = PeftModel.from_pretrained(base.float(), str(adapter_folder)).merge_and_unload()
    merged.to(dtype)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(tmp)
    _copy_tokenizer_files(base_folder, tmp)
    record = {"base": str(base_folder.resolve()), "adapter": str(adapter_folder.resolve())}
    (tmp / MERGED_MARKER).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    """The files of `source` save_pretrained does not write (tokenizer, chat template), not
    its weights and not its folders (adapters/, merged/)."""
    for path in source.iterdir():
        if not path.is_file() or path.name.endswith(_WEIGHT_FILES):
            continue
        if path.name in _WRITTEN_BY_SAVE or (out / path.name).exists():
            continue
        shutil.copy2(path, out / path.name)
