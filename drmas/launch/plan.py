"""`drmas plan`: where a run's processes would go and the memory each needs, from the
config alone.

    drmas plan [overrides] [--gpu-gib G] ── plan_placement (placement.py) ──> the placement
                                         ── config.json, where one is here ──> the budget

`drmas prepare` resolves every model through the Hugging Face cache before it prints the
placement, so on a head node where the weights are not downloaded yet it stops first and
nobody sees where the processes would go. This reads nothing but the config and each
model's `config.json` when one is already here (a local folder or the Hugging Face cache;
`hf download REPO config.json` fetches that one file): nothing is downloaded, built or
written. The budget counts what is known before a step runs: weights, gradients and
AdamW state per learner rank (FSDP2 shards them over the model's ranks) and the weights
each engine loads; activations and the engines' KV cache come on top, inside the
fractions placement gives (placement.learner_memory, gpu_memory_utilization).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.launch.placement import Placement, PlacementError, plan_placement, visible_gpus

if TYPE_CHECKING:
    from drmas.config import DrmasConfig

GIB = 2**30
_ENGINE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSize:
    """A model's parameter count, or why it is unknown here."""

    params: int | None
    source: str
    """Where the count came from, or what to do to get it."""


def learner_bytes_per_param(precision: str) -> int:
    """Bytes a trained parameter costs on the learner before sharding: the master weight,
    its gradient and AdamW's two moments, all in the master dtype (fp32 under fp32 and
    bf16-mixed; bf16 under bf16-pure), as drmas/learners/trainer.py's precision_plan keeps
    them."""
    return 8 if precision == "bf16-pure" else 16


def parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of a decoder-only causal LM (Llama, Qwen2/3, Mistral families) from its
    config.json; None for shapes this does not know (mixture of experts, no hidden_size)."""
    config = config.get("text_config", config)
    keys = ("hidden_size", "num_hidden_layers", "intermediate_size", "vocab_size")
    if any(k not in config for k in keys) or any(
        k in config for k in ("num_experts", "num_local_experts", "n_routed_experts")
    ):
        return None
    h, layers, inner, vocab = (int(config[k]) for k in keys)
    heads = int(config.get("num_attention_heads", 1))
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or h // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = h * q + 2 * h * kv + q * h
    if config.get("model_type") == "qwen2" or config.get("attention_bias"):
        attention += q + 2 * kv  # biases of q, k and v
    if config.get("model_type") == "qwen3":
        attention += 2 * head_dim  # q_norm and k_norm
    per_layer = attention + 3 * h * inner + 2 * h  # gate/up/down; two RMSNorms
    head = 0 if config.get("tie_word_embeddings", False) else vocab * h
    return layers * per_layer + vocab * h + head + h  # + the final norm


def model_size(path: str, revision: str = "") -> ModelSize:
    """The parameter count of `models.<m>.path` from a config.json already on this machine."""
    if path.startswith("builtin:"):
        return ModelSize(None, "a builtin: model, built by drmas train (a few MiB)")
    folder = Path(path).expanduser()
    if folder.is_dir():
        found: Path | None = folder / "config.json"
        where = f"{folder}/config.json"
    else:
        found, where = _cached_config(path, revision), "config.json in the Hugging Face cache"
    if found is None or not found.is_file():
        return ModelSize(
            None,
            f"no config.json here: `hf download {path} config.json` fetches only that file",
        )
    count = parameter_count(json.loads(found.read_text()))
    if count is None:
        return ModelSize(None, f"{where} describes a shape this plan does not size")
    return ModelSize(count, where)


def _cached_config(repo: str, revision: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(repo, "config.json", revision=revision or None)
    except ValueError:  # not a valid Hub id either
        return None
    return Path(hit) if isinstance(hit, str) else None


def _gib(params: int | None, bytes_per: float) -> str:
    return "size unknown" if params is None else f"{params * bytes_per / GIB:.1f} GiB"


def budget(cfg: DrmasConfig, placement: Placement, gpu_gib: float | None = None) -> str:
    """Per GPU: what each process on it holds and the fraction of the GPU it may use; with
    `gpu_gib`, whether the known part fits in that fraction."""
    sizes = {m: model_size(mc.path, mc.revision) for m, mc in cfg.models.items()}
    lines = ["models:"]
    for m, s in sorted(sizes.items()):
        count = "" if s.params is None else f"{s.params / 1e9:.2f} B parameters, "
        lines.append(f"  {m} ({cfg.models[m].path}): {count}{s.source}")
    shared = set(placement.shared)
    rows: dict[int, list[tuple[str, float, float | None]]] = defaultdict(list)
    for model, ranks in sorted(placement.learners.items()):
        for rank, gpu in enumerate(ranks):
            text, need = _learner_row(cfg, model, rank, sizes[model])
            share = cfg.placement.learner_memory if gpu in shared else 1.0
            rows[gpu].append((text, share, need))
    served = cfg.actor.models or sorted(cfg.models)
    for index, gpus in enumerate(placement.actors):
        for model in served:
            text, share, need = _engine_row(cfg, model, index, sizes[model])
            for gpu in gpus:
                rows[gpu].append((text, share, need))
    lines.append(
        "memory budget per GPU (weights, gradients and AdamW state; activations and KV "
        "cache come on top, inside each share):"
    )
    for gpu in range(placement.gpus):
        lines.append(f"  GPU {gpu}:" + ("" if rows[gpu] else " idle"))
        for text, share, need in rows[gpu]:
            lines.append(f"    {text}; may use {share:g} of the GPU{_fits(need, share, gpu_gib)}")
    return "\n".join(lines)


def _learner_row(
    cfg: DrmasConfig, model: str, rank: int, size: ModelSize
) -> tuple[str, float | None]:
    mc = cfg.models[model]
    world = cfg.world_size_of(model)
    if cfg.has_adapters(model):  # a frozen base in the master dtype; adapters are small
        per = (2 if mc.precision == "bf16-pure" else 4) / world
        what = f"frozen base ({mc.precision}) + LoRA adapters"
    else:
        per = learner_bytes_per_param(mc.precision) / world
        what = f"weights, grads, AdamW ({mc.precision})"
    if cfg.algorithm.loss.kl_coef > 0:  # the unsharded KL reference, in the compute dtype
        per += 4 if mc.precision == "fp32" else 2
        what += " + KL reference"
    text = f"learner {model} rank {rank}: {_gib(size.params, per)} of {what}, 1/{world} shard"
    return text, None if size.params is None else size.params * per / GIB


def _engine_row(
    cfg: DrmasConfig, model: str, index: int, size: ModelSize
) -> tuple[str, float, float | None]:
    engine = cfg.actor.engine_of(model)
    per = _ENGINE_BYTES[engine.dtype] / engine.tensor_parallel_size
    reserves = engine.name in ("vllm", "sglang")
    share = engine.gpu_memory_utilization if reserves else 1.0
    tp = (
        f", 1/{engine.tensor_parallel_size} tensor-parallel"
        if engine.tensor_parallel_size > 1
        else ""
    )
    text = f"actor-{index} {engine.name} {model}: {_gib(size.params, per)} of {engine.dtype} weights{tp}"
    if not reserves:
        text += " (reserves nothing: shares the GPU with whatever else is on it)"
    return text, share, None if size.params is None else size.params * per / GIB


def _fits(need: float | None, share: float, gpu_gib: float | None) -> str:
    if gpu_gib is None or need is None:
        return ""
    room = share * gpu_gib
    verdict = "fits" if need <= room else "DOES NOT FIT"
    return f" = {room:.1f} GiB of {gpu_gib:g}: {verdict}"


def plan_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("overrides", nargs="*", help="hydra overrides, e.g. placement.gpus=8")
    sp.add_argument("--config", help="a resolved RUN_DIR/config.yaml to load instead of configs/")
    sp.add_argument(
        "--gpu-gib",
        type=float,
        default=None,
        help="memory of one GPU of the target node (e.g. 80, 141): say whether each "
        "process's known part fits its share",
    )


def run_plan(args: argparse.Namespace, cfg: DrmasConfig) -> int:
    """Print the placement and its memory budget; 2 when the plan cannot work."""
    from drmas.launch.placement import adapter_plan
    from drmas.launch.train import check_run

    try:
        check_run(cfg)
        placement = plan_placement(cfg, visible_gpus(cfg))
    except (PlacementError, ValueError) as exc:
        print(f"drmas plan: {exc}", file=sys.stderr)
        return 2
    if placement is None:
        print(
            "a CPU run: no GPUs to place (add placement.gpus=N to plan for a node you are not on)"
        )
        return 0
    print(placement.describe())
    if adapters := adapter_plan(cfg):
        print(adapters)
    print(budget(cfg, placement, args.gpu_gib))
    return 0
