"""A learner rank's model in and out: the HF folder it starts from, loading it, and the
trained weights out again, as full tensors under their HF names.

In: `checkpoint_folder` (a builtin:<name> is built once per cache) and `load_causal_lm`.
Out: `full_tensors` gathers FSDP2 shards one parameter at a time, for the weight publish to
the actors (drmas/transports/weights/) and for `save_hf_folder`, which writes the model
at the end of a run as an HF folder a user or an engine loads like any other.
Used by drmas/learners/trainer.py, whose methods of the same names are the collectives.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from drmas.config.model import weights_dtype
from drmas.transports.weights import TensorSpec

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Prefixes wrappers put in front of HF parameter names (torch.compile, activation
# checkpointing, FSDP1); FSDP2 itself keeps names as they are.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_WRITTEN_BY_SAVE = ("config.json", "generation_config.json")


# ------------------------------------------------------------------------ in
def checkpoint_folder(cfg: DrmasConfig, model: str) -> Path:
    """The model's HF folder; a builtin:<name> is built once, then taken from the cache."""
    from drmas.models.builtin import resolve_model_path

    model_cfg = cfg.models[model]
    return resolve_model_path(
        model_cfg.path, cfg.run.cache_dir or None, model_cfg.warmstart, model_cfg.revision
    )


def load_causal_lm(folder: Path, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    lm.to(device)  # type: ignore[arg-type]  # transformers' stub of .to is too narrow
    return lm


# ------------------------------------------------------------------------ out
def publish_dtype(precision: str) -> torch.dtype:
    """The dtype weights go to the actors in (the engines compute in it) for
    ModelConfig.precision."""
    return _DTYPES[weights_dtype(precision)]


def hf_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def param_specs(
    model: torch.nn.Module, dtype: torch.dtype, only: list[str] | None = None
) -> list[TensorSpec]:
    """(HF name, full shape, dtype) of what full_tensors(model, dtype=dtype, only=only)
    yields, in order; local (no collective: a DTensor knows its full shape)."""
    name = str(dtype).removeprefix("torch.")
    return [TensorSpec(hf_name(n), tuple(p.shape), name) for n, p in _selected(model, only)]


def full_tensors(
    model: torch.nn.Module,
    device: torch.device | str | None = "cpu",
    dtype: torch.dtype | None = None,
    only: list[str] | None = None,
    *,
    copy: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) per parameter, gathered one at a time. A collective: every
    rank must exhaust it; every rank gets the full tensors (only rank 0 needs them).
    `device` None keeps them where they were gathered (CUDA for an NCCL publish);
    `dtype` None keeps the master dtype (checkpoints), else casts (publishing);
    `only`: these parameters (named_parameters() names), in this order, instead of all.
    With `copy` the tensors never alias the live parameters, so they survive later steps;
    without it a one-rank model in the wanted dtype and device yields its parameters
    themselves, for a consumer that is done with each before the next step (a publish: a
    538 MB copy cost 0.4 s of it on a 2-core CPU)."""
    for name, param in _selected(model, only):
        value = param.detach()
        full = value.full_tensor() if isinstance(value, DTensor) else value
        full = full if device is None else full.to(device)
        full = full if dtype is None else full.to(dtype)
        shard = value.to_local() if isinstance(value, DTensor) else value
        if copy and _same_storage(full, shard):  # one rank: "gathering" returns the shard itself
            full = full.clone()
        yield hf_name(name), full


def save_hf_folder(
    model: PreTrainedModel, state: dict[str, torch.Tensor], source: Path, out: Path
) -> None:
    """Write `state` (full tensors by HF name) as an HF folder: config, weights, and the
    source folder's tokenizer files, when it has any."""
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state)
    _copy_tokenizer_files(source, out)


def _selected(
    model: torch.nn.Module, only: list[str] | None
) -> list[tuple[str, torch.nn.Parameter]]:
    params = list(model.named_parameters())
    if only is None:
        return params
    by_name = dict(params)
    return [(name, by_name[name]) for name in only]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _copy_tokenizer_files(source: Path, out: Path) -> None:
    if not source.is_dir():
        return
    for path in source.iterdir():
        if not path.is_file() or path.name.endswith(_WEIGHT_FILES):
            continue
        if path.name in _WRITTEN_BY_SAVE or (out / path.name).exists():
            continue
        shutil.copy2(path, out / path.name)
