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
- count each adapter's own version U[x]: the learner steps (batches) that changed it,
  i.e. whose batch held samples of an agent training x. Every rank runs every agent's
  micro-batches, so every rank counts the same U; rank 0 sends it to the broker
  (BatchRequest/PublishRequest.adapter_versions), which plans staleness and publishes
  per adapter by it, and checkpoints keep it;
- publish only the adapters (drmas/transports/weights/), under their PeftModel names,
  sorted, and of those only the ones the broker's plan names (the others every actor
  holds already), and export the base plus one PEFT folder per adapter at the end of a
  run.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Collection, Iterable, Iterator
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
    adapters_off,
    add_adapters,
    is_adapter_param,
    save_adapter_folder,
    write_merged_folders,
)
from drmas.transports.weights import NamedTensors, TensorSpec

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
        self.versions: dict[str, int] = dict.fromkeys(self.names, 0)
        """U: adapter -> the learner steps that changed it (the same on every rank)."""
        self._changed: set[str] = set()  # adapters the batch being trained has changed

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

    def off(self) -> contextlib.AbstractContextManager[None]:
        """Forward passes inside run the frozen base alone (the KL reference); the active
        adapter is back on after."""
        return adapters_off(self.policy, self.active)

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

    # ------------------------------------------------------- adapter versions
    def note_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Right before an optimizer update that runs (a finite gradient norm): the
        adapters it changes are those with gradients. AdamW skips a parameter without one
        (also its weight decay), and an adapter has gradients exactly when some rank ran
        micro-batches of one of its agents, i.e. the batch held samples of such an agent,
        so this is the same on every rank."""
        for name, group in zip(self.names, optimizer.param_groups):
            if any(p.grad is not None for p in group["params"]):
                self._changed.add(name)

    def advance(self) -> dict[str, float]:
        """After the last update of a batch: U[x] + 1 for every adapter the batch changed
        (once per batch, whatever the number of PPO updates; a batch whose every update
        was skipped changed nothing). Returns the step's `adapter_version/<adapter>`
        metrics, at the version after the step."""
        for name in self._changed:
            self.versions[name] += 1
        self._changed.clear()
        return {f"adapter_version/{name}": float(u) for name, u in self.versions.items()}

    def restore(self, saved: object, version: int) -> None:
        """U from a checkpoint of model version `version`.

        A checkpoint without U (`saved` None) was written before adapters had versions of
        their own. It is resumed with U[x] = `version` for every adapter: the largest value
        the definition allows (every step changed every adapter), so U stays monotone and
        within the version, and what it overstates only errs on the safe side: the next
        publishes carry an adapter that had not changed (never leave out one that had),
        and a sample of a version before the resume looks staler than it was, never
        fresher. The alternative, zeros, would claim that trained adapters never changed.
        """
        if saved is None:
            log.warning(
                "%s: the checkpoint of v%d has no adapter versions (written before they "
                "existed); resuming with every adapter at version %d",
                self.model, version, version,
            )  # fmt: skip
            self.versions = dict.fromkeys(self.names, version)
            return
        if (
            not isinstance(saved, dict)
            or sorted(saved) != sorted(self.names)
            or not all(type(u) is int and 0 <= u <= version for u in saved.values())
        ):
            raise ValueError(
                f"{self.model}: the checkpoint of v{version} has adapter versions {saved!r}; "
                f"expected whole numbers 0..{version} for exactly the adapters {self.names} "
                "(did the config's agents or adapters change since? resume with the config "
                "the run was started with)"
            )
        self.versions = {name: int(saved[name]) for name in self.names}

    # -------------------------------------------------------------- weights out
    @staticmethod
    def published(policy: torch.nn.Module, adapters: Collection[str] | None = None) -> list[str]:
        """Parameter names of what a publish carries, in its order: the adapters (only
        `adapters`, when given), sorted by their wire names."""
        names = adapter_param_names(policy)
        if adapters is not None:
            names = [n for n in names if adapter_of_param(n) in adapters]
        return sorted(names, key=model_io.hf_name)

    def specs(
        self, policy: torch.nn.Module, dtype: torch.dtype, adapters: Collection[str] | None = None
    ) -> list[TensorSpec]:
        return model_io.param_specs(policy, dtype, self.published(policy, adapters))

    def to_send(self, planned: Iterable[str]) -> list[str]:
        """The adapters a WeightGroupPlan names, checked against this base's."""
        planned = sorted(planned)
        unknown = [name for name in planned if name not in self.names]
        if unknown:
            raise ValueError(
                f"the weight plan of {self.model} names adapters {unknown}, which are not "
                f"on this base (its adapters: {self.names}); broker and learner disagree "
                "on the config: start both from the same one"
            )
        return planned

    @staticmethod
    def only(stream: NamedTensors, adapters: Collection[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of `stream` (wire names) that belong to `adapters`, in its order.
        Exhausting it exhausts `stream`, also past the last tensor it yields, so a stream
        that fingerprints what passes through it (transports/digest.py's `hashing`) sees
        every adapter."""
        for name, tensor in stream:
            if adapter_of_param(name) in adapters:
                yield name, tensor

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
        if rank == 0 and self.cfg.models[self.model].lora.export_merged:
            write_merged_folders(out, self.names)  # after the barrier: no rank waits for it
