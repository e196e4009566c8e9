"""LoRA adapters per agent in a learner rank: what a Trainer does differently when its model
is a frozen base (`models.<m>.lora.rank > 0`, DrmasConfig.has_adapters).

drmas/learners/trainer.py holds one `AdapterSet` and asks it to
- wrap the loaded base with the adapters (drmas/models/lora.py's `add_adapters`, the same
  call the hf engines make) before FSDP2 shards it; the base is frozen;
- give AdamW one parameter group per adapter at its own learning rate (cfg.lr_of), with
  its state created up front, so that a checkpoint holds every adapter's state, also of
  an adapter none of whose agents has trained yet;
- activate an agent's adapter before its micro-batches: the other adapters are not in the
  graph, get no gradient and are left exactly as they were by AdamW;
- clip each adapter's gradient on its own (one agent's large gradient does not shrink
  another's update);
- publish only the adapters (drmas/transports/weights/), under their PeftModel names,
  sorted, and export the base plus one PEFT folder per adapter at the end of a run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from drmas.learners import model_io
from drmas.models.lora import (
    ADAPTERS_FOLDER,
    activate_adapter,
    adapter_of_param,
    adapter_param_names,
    add_adapters,
    is_adapter_param,
    save_adapter_folder,
)
from drmas.transports.weights import TensorSpec

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.learner")

_BASE_PREFIX = "base_model.model."


def base_hf_name(name: str) -> str:
    """The HF name of a frozen base parameter of a PeftModel:
    `base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` ->
    `model.layers.0.self_attn.q_proj.weight`."""
    return name.removeprefix(_BASE_PREFIX).replace(".base_layer.", ".")


class AdapterSet:
    """The adapters of one LoRA base (in cfg.adapters_of order) and which agent trains
    which, for the Trainer of that model."""

    def __init__(self, cfg: DrmasConfig, model: str) -> None:
        self.cfg = cfg
        self.model = model
        self.names = cfg.adapters_of(model)
        self.of_agent = {agent: cfg.adapter_of(agent) for agent in cfg.agents_of(model)}
        self.active = ""
        self._policy: PeftModel | None = None

    @property
    def policy(self) -> PeftModel:
        """The wrapped model (sharded by the Trainer after `wrap`)."""
        if self._policy is None:
            raise RuntimeError("AdapterSet.wrap() has not wrapped a model yet")
        return self._policy

    def wrap(self, lm: PreTrainedModel, master: torch.dtype) -> PeftModel:
        """`lm` (the base, unsharded) with every adapter; the adapters' weights in `master`
        (fp32, or bf16 under bf16-pure), the base frozen."""
        peft_model = add_adapters(lm, self.cfg.models[self.model].lora, self.names)
        for name, param in peft_model.named_parameters():
            if is_adapter_param(name) and param.dtype != master:
                param.data = param.data.to(master)
        self.active = self.names[0]
        self._policy = peft_model
        return peft_model

    def param_groups(self, policy: torch.nn.Module) -> list[dict[str, Any]]:
        """One AdamW group per adapter, in self.names order, at the adapter's lr."""
        params: dict[str, list[torch.nn.Parameter]] = {name: [] for name in self.names}
        for name, param in policy.named_parameters():
            if is_adapter_param(name):
                params[adapter_of_param(name)].append(param)
        return [
            {"params": params[name], "lr": self.cfg.lr_of(self.model, name)} for name in self.names
        ]

    @staticmethod
    def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
        """AdamW's own first-step state (step 0, zero moments) for every parameter now,
        instead of at its first gradient: the step with the first gradient then computes
        what it would have, and a checkpoint always has the state of every adapter."""
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in optimizer.param_groups:
            if group.get("fused") or group.get("capturable") or group.get("amsgrad"):
                raise ValueError("LoRA learners use plain AdamW (not fused/capturable/amsgrad)")
            for param in group["params"]:
                optimizer.state[param] = {
                    "step": torch.tensor(0.0, dtype=scalar),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }

    def use(self, agent: str) -> None:
        """Forward passes from now on use `agent`'s adapter."""
        adapter = self.of_agent[agent]
        if adapter != self.active:
            activate_adapter(self.policy, adapter)
            self.active = adapter

    @staticmethod
    def clip(optimizer: torch.optim.Optimizer, max_norm: float) -> float:
        """Clip each adapter's gradient (one optimizer group) to `max_norm` on its own;
        returns the norm of all adapters' gradients together, before clipping. A
        collective for the adapters that have gradients (the same on every rank: every
        rank runs every agent's micro-batches)."""
        total = 0.0
        for group in optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            total += float(norm) ** 2
        return math.sqrt(total)

    # -------------------------------------------------------------- weights out
    @staticmethod
    def published(policy: torch.nn.Module) -> list[str]:
        """Parameter names of what a publish carries, in its order: the adapters, sorted by
        their wire names."""
        return sorted(adapter_param_names(policy), key=model_io.hf_name)

    def specs(self, policy: torch.nn.Module, dtype: torch.dtype) -> list[TensorSpec]:
        return model_io.param_specs(policy, dtype, self.published(policy))

    def tensors(
        self, policy: torch.nn.Module, device: torch.device | str | None, dtype: torch.dtype | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A collective, like model_io.full_tensors: the adapters only."""
        return model_io.full_tensors(policy, device, dtype, self.published(policy))

    def save(self, source: Path, out: Path, rank: int) -> None:
        """Collective: rank 0 writes the base as an HF folder at `out` (config, weights,
        tokenizer files, as a full fine-tuning run does) and each adapter as a PEFT folder
        at out/adapters/<adapter>/, which `peft.PeftModel.from_pretrained(base, folder)`
        loads."""
        base: dict[str, torch.Tensor] = {}
        adapters: dict[str, list[tuple[str, torch.Tensor]]] = {name: [] for name in self.names}
        policy = self.policy
        for name, tensor in model_io.full_tensors(policy, "cpu"):
            if rank != 0:
                continue
            if is_adapter_param(name):
                adapters[adapter_of_param(name)].append((name, tensor))
            else:
                base[base_hf_name(name)] = tensor
        if rank == 0:
            base_lm = cast("PreTrainedModel", policy.get_base_model())
            model_io.save_hf_folder(base_lm, base, source, out)
            for adapter, tensors in adapters.items():
                folder = out / ADAPTERS_FOLDER / adapter
                save_adapter_folder(policy, adapter, tensors, folder, str(out.resolve()))
            log.info("saved %s with adapters %s to %s", self.model, self.names, out)
        dist.barrier()
