"""How a learner's model is laid out for FSDP2 (drmas/learners/trainer.py shards it):
the dtype its masters and AdamW state are kept in and the mixed-precision policy, per
ModelConfig.precision; and the decoder layers it shards one by one (also the layers
drmas/cpu_share.py re-chooses CPU threads at)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy


def precision_plan(precision: str) -> tuple[torch.dtype, MixedPrecisionPolicy | None]:
    """ModelConfig.precision -> (dtype of the weights AdamW updates, FSDP2 policy).
    bf16-mixed keeps fp32 masters and optimizer state; FSDP2 casts each layer's weights to
    bf16 when it gathers them for forward/backward and reduces gradients in fp32."""
    if precision == "fp32":
        return torch.float32, None
    if precision == "bf16-mixed":
        return torch.float32, MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if precision == "bf16-pure":
        return torch.bfloat16, None
    raise ValueError(f"precision {precision!r} is not fp32, bf16-mixed or bf16-pure")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (HF causal LMs keep them in model.layers;
    a PeftModel keeps the causal LM in get_base_model())."""
    get_base_model = getattr(model, "get_base_model", None)
    base = get_base_model() if callable(get_base_model) else model
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no .model.layers to shard")
    return list(layers)
