"""One learner rank of one model: FSDP2-sharded policy, AdamW, the PPO step.

Every public method except `param_specs` and `use_agent` is a collective of the model's
learner group: all ranks call it, in the same order, or the group hangs until its timeout.
Loading the model and gathering it out again (publish, final save) are
drmas/learners/model_io.py's. On a LoRA base (models.<m>.lora.rank > 0) the base is
frozen and each agent trains its adapter: drmas/learners/adapters.py says how. How a batch
shard becomes the updates and micro-batches `step` runs is drmas/learners/updates.py's.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from drmas import cpu_share
from drmas.finite import describe, finite
from drmas.learners import model_io, scoring, updates
from drmas.learners.adapters import AdapterSet
from drmas.learners.batching import MicroBatch
from drmas.learners.loss import policy_loss
from drmas.learners.sharding import decoder_layers, precision_plan
from drmas.protocol.arrays import unpack_ids
from drmas.protocol.messages import BatchShard
from drmas.protocol.validate import context_from_config
from drmas.transports.weights import TensorSpec

if TYPE_CHECKING:
    from peft import PeftModel

    from drmas.config import DrmasConfig

log = logging.getLogger("drmas.learner")

# Metric sums from policy_loss that become per-token means.
_TOKEN_MEANS = {
    "pg_clipped_tokens": "clip_frac",
    "ppo_kl_sum": "ppo_kl",
    "is_weight_sum": "is_weight",
    "is_capped_tokens": "is_capped_frac",
    "entropy_sum": "entropy",
    "kl_sum": "kl",
}


def _nothing() -> None:
    pass


class Trainer:
    """FSDP2 policy + AdamW for `model`: one or more PPO updates per batch."""

    def __init__(
        self,
        cfg: DrmasConfig,
        model: str,
        rank: int,
        world_size: int,
        device: torch.device | str,
        *,
        entropy_metric: bool | None = None,
    ) -> None:
        """`entropy_metric`: also compute the policy entropy for metrics when the loss does
        not need it; None = only for vocabularies up to 32k, where it is cheap."""
        self.cfg = cfg
        self.name = model
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.agents = cfg.agents_of(model)
        self.source = model_io.checkpoint_folder(cfg, model)
        self.loss_cfg = cfg.algorithm.loss
        model_cfg = cfg.models[model]
        self.publish_dtype = model_io.publish_dtype(model_cfg.precision)
        """The dtype weights go to the actors in (the engines compute in it)."""
        self.lora = AdapterSet(cfg, model) if cfg.has_adapters(model) else None
        """The adapters per agent on a LoRA base; None: the whole model trains."""
        self.model = self._sharded_policy()
        self.vocab_size = int(self.model.config.vocab_size)
        self.pad_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.context = context_from_config(self.model.config.to_dict()) or 1 << 30
        """Prompt + response tokens the model takes; longer samples are left out."""
        self.optimizer = torch.optim.AdamW(
            self.lora.param_groups(self.model) if self.lora else self.model.parameters(),
            lr=cfg.lr_of(model),
            weight_decay=model_cfg.weight_decay,
            betas=(model_cfg.betas[0], model_cfg.betas[1]),
            # the fused kernel for a whole model: 0.08 s a step for SmolLM2-135M on 2 CPU
            # cores against 0.42 s per-tensor; adapters keep plain AdamW (their own state
            # set-up, AdapterSet.init_optimizer_state), and they are small
            fused=None if self.lora else _fused_adam_ok(self.device, self.model),
        )
        if self.lora:
            self.lora.init_optimizer_state(self.optimizer)
        self.refuse_non_finite(0, "start")
        self.reference = self._reference()
        if entropy_metric is None:
            entropy_metric = self.vocab_size <= 32768
        self.with_entropy = entropy_metric or self.loss_cfg.entropy_coef != 0
        if self.device.type == "cpu" and cpu_share.start_from_env():
            cpu_share.follow_layers(decoder_layers(self.model))  # threads chosen per layer

    def _sharded_policy(self) -> PreTrainedModel | PeftModel:
        """The policy in its master dtype, in train mode, each decoder layer and then the
        whole model sharded over the learner group (FSDP2, also for world size 1); on a
        LoRA base, the PeftModel of the base and its adapters."""
        model_cfg = self.cfg.models[self.name]
        master, policy = precision_plan(model_cfg.precision)
        if model_cfg.precision == "bf16-pure" and self.rank == 0:
            log.warning(
                "models.%s.precision=bf16-pure: the weights themselves are bf16, so AdamW "
                "updates below ~0.4 %% of a weight are lost (at lr 1e-6 most weights never "
                "move); use bf16-mixed to train",
                self.name,
            )
        lm = model_io.load_causal_lm(self.source, master, self.device)
        self.keeps_logits = "logits_to_keep" in inspect.signature(lm.forward).parameters
        """The model computes logits of chosen positions only (token_stats)."""
        lm.train()
        if model_cfg.activation_checkpointing:
            # Each decoder layer's activations are recomputed in backward instead of kept
            # (non-reentrant, which composes with FSDP2's per-layer gathers).
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # adapters before sharding: FSDP2 shards the frozen base and the adapters alike
        model = self.lora.wrap(lm, master) if self.lora else lm
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp_policy = policy or MixedPrecisionPolicy()  # the default policy casts nothing
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
        fully_shard(model, mesh=mesh, mp_policy=mp_policy)
        return model

    def _reference(self) -> PreTrainedModel | None:
        """The frozen reference of the KL term, None without one (kl_coef 0) and on a LoRA
        base (whose reference is the base itself, adapters off: `_reference_logprobs`).
        Unsharded and only ever run forward under no_grad; in the compute dtype: it never
        trains, so it needs no fp32 master."""
        if not self.loss_cfg.kl_coef > 0 or self.lora:
            return None
        reference = model_io.load_causal_lm(self.source, self.publish_dtype, self.device)
        reference.eval().requires_grad_(False)
        return reference

    # ------------------------------------------------------------------ training
    def step(self, shard: BatchShard, tick: Callable[[], None] = _nothing) -> dict[str, float]:
        """Train on this rank's shard of a batch: `ppo_epochs` passes of `ppo_minibatches`
        optimizer updates each; returns the batch's metrics (identical on every rank).
        `tick` runs before each micro-batch (heartbeats). Marked computing for the CPUs
        an asynchronous CPU run shares (drmas/cpu_share.py)."""
        with cpu_share.computing():
            return self._step(shard, tick)

    def _step(self, shard: BatchShard, tick: Callable[[], None]) -> dict[str, float]:
        self._check(shard)
        shard, overlong = updates.drop_overlong(shard, self.context, self.device)
        minibatches = self._minibatches(shard)
        several = len(minibatches) * self.cfg.learner.ppo_epochs > 1
        if several:  # π_old = the policy before the first update, fixed for every update
            self._fix_old_logprobs(minibatches, tick)
        sums: dict[str, torch.Tensor] = {}
        norms: list[float] = []
        agent_norms = torch.zeros(len(self.agents), dtype=torch.float64)
        agent_updates = torch.zeros(len(self.agents), dtype=torch.float64)
        skipped = 0
        for _ in range(self.cfg.learner.ppo_epochs):
            for mini in minibatches:
                grad_norm, agent_sq = self._update(mini, sums, tick)
                norms.append(grad_norm)
                skipped += not math.isfinite(grad_norm)
                ran = torch.tensor([bool(mini.plan[a]) for a in self.agents], dtype=torch.float64)
                agent_norms += agent_sq.sqrt() * ran
                agent_updates += ran
        metrics = self._metrics(shard, sums, norms, agent_norms / agent_updates.clamp(min=1))
        metrics[f"skipped_steps/{self.name}"] = float(skipped)
        metrics[f"overlong_samples/{self.name}"] = float(overlong)  # left out: over context
        if self.lora:
            metrics |= self.lora.advance()  # adapter_version/<adapter>, after this batch
        if self.cfg.learner.per_agent_grad_norm:
            for agent, n in zip(self.agents, agent_updates.tolist()):
                if not n:
                    metrics.pop(f"agent_grad_norm/{agent}", None)
        return metrics

    def _update(
        self, mini: updates.MiniBatch, sums: dict[str, torch.Tensor], tick: Callable[[], None]
    ) -> tuple[float, torch.Tensor]:
        """One optimizer update on one mini-batch: (pre-clip grad norm, per-agent grad²)."""
        self.optimizer.zero_grad(set_to_none=True)
        agent_sq = torch.zeros(len(self.agents), dtype=torch.float64)
        acting = [a for a, agent in enumerate(self.agents) if mini.plan[agent]]
        # with one agent acting, its gradient is the update's: its norm is the clip's
        per_agent = self.cfg.learner.per_agent_grad_norm and len(acting) > 1
        for a, agent in enumerate(self.agents):
            before = self._grad_shards() if per_agent else None
            self.use_agent(agent)
            for i, mb in enumerate(mini.plan[agent]):
                tick()
                old = mini.old_logprobs[agent][i] if mini.old_logprobs else None
                self._forward_backward(mb.to(self.device), mini.tokens, mini.samples, old, sums)
            if before is not None and mini.plan[agent]:
                agent_sq[a] = self._delta_sq(before)
        if per_agent:
            agent_sq = agent_sq.to(self.device)
            dist.all_reduce(agent_sq)  # each rank holds its shards' part of every agent's norm
            agent_sq = agent_sq.cpu()
        grad_norm = self._clip()
        if self.cfg.learner.per_agent_grad_norm and len(acting) == 1:
            agent_sq[acting[0]] = grad_norm**2
        if math.isfinite(grad_norm):
            if self.lora:
                self.lora.note_update(self.optimizer)
            self.optimizer.step()
        else:
            log.warning("%s: non-finite gradient norm, optimizer step skipped", self.name)
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, agent_sq

    def _minibatches(self, shard: BatchShard) -> list[updates.MiniBatch]:
        """This rank's shard as the batch's optimizer updates (a collective: updates.deal)."""
        return updates.deal(shard, self.agents, self.cfg.learner, self.pad_id, self.device)

    @torch.no_grad()
    def _fix_old_logprobs(
        self, minibatches: list[updates.MiniBatch], tick: Callable[[], None]
    ) -> None:
        """π_old's log-probs of every micro-batch, before any update of this batch."""
        for mini in minibatches:
            for agent in self.agents:
                self.use_agent(agent)
                mini.old_logprobs[agent] = []
                for mb in mini.plan[agent]:
                    tick()
                    logprobs, _ = self.token_stats(self.model, mb.to(self.device), False)
                    mini.old_logprobs[agent].append(logprobs)

    def _check(self, shard: BatchShard) -> None:
        if (shard.model, shard.rank, shard.world_size) != (self.name, self.rank, self.world_size):
            raise ValueError(
                f"shard for {shard.model} rank {shard.rank}/{shard.world_size} reached "
                f"learner {self.name} rank {self.rank}/{self.world_size}"
            )
        if len(shard.weights) != len(shard.samples):
            raise ValueError(f"{len(shard.weights)} weights for {len(shard.samples)} samples")
        for s in shard.samples:  # before any collective: a bad id would crash the embedding
            for raw in (s.prompt_ids, s.response_ids):
                ids = unpack_ids(raw)
                if len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab_size:
                    raise ValueError(
                        f"{s.agent} sample has a token id outside [0, {self.vocab_size})"
                    )

    def _forward_backward(
        self,
        mb: MicroBatch,
        total_tokens: int,
        total_samples: int,
        old_logprobs: torch.Tensor | None,
        sums: dict[str, torch.Tensor],
    ) -> None:
        """`total_*`: the update's real token/sample counts over all ranks (loss normaliser);
        `old_logprobs` None: π_old is the current policy (one update per batch)."""
        logprobs, entropy = self.token_stats(self.model, mb, self.with_entropy)  # [B, L-1]
        ref_logprobs = self._reference_logprobs(mb) if self.loss_cfg.kl_coef > 0 else None
        if old_logprobs is None:
            # One update per batch: π_old (the policy the batch is trained from) is exactly
            # the current π_θ before the update, so its log-probs are ours, detached.
            old_logprobs = logprobs.detach()
        loss, metrics = policy_loss(
            logprobs,
            old_logprobs,
            mb.behaviour_logprobs,
            mb.advantages,
            mb.mask,
            self.loss_cfg,
            total_tokens=total_tokens,
            total_samples=total_samples,
            entropy=entropy,
            ref_logprobs=ref_logprobs,
        )
        # The loss is this micro-batch's share of the update's loss, so the update's gradient
        # is the SUM over ranks; FSDP reduce-scatter AVERAGES over ranks.
        (loss * self.world_size).backward()
        metrics["loss"] = loss.detach()
        for key, value in metrics.items():
            sums[key] = sums.get(key, torch.zeros((), dtype=torch.float64)) + value.double().cpu()

    @torch.no_grad()
    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """The KL reference's log-probs of `mb`: the separate frozen copy, or on a LoRA base
        the sharded base with every adapter off (after the policy's forward, so FSDP2 has
        already made the adapters' unsharded parameters, with requires_grad)."""
        if self.lora:
            with self.lora.off():
                return self.token_stats(self.model, mb, False)[0]
        assert self.reference is not None
        return self.token_stats(self.reference, mb, False)[0]

    def token_stats(
        self, model: torch.nn.Module, mb: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs of mb.targets (and entropy) at the temperature its agent
        sampled with (agents.<name>.sampling over `sampling`: a micro-batch holds one
        agent), in the padded [B, L-1] frame (drmas/learners/scoring.py: only the positions
        that predict response tokens go through the LM head when the model allows it)."""
        temperature = self.cfg.sampling_of(mb.agent).temperature
        return scoring.token_stats(model, mb, temperature, with_entropy, self.keeps_logits)

    def use_agent(self, agent: str) -> None:
        """On a LoRA base, forward passes from now on use `agent`'s adapter (local)."""
        if self.lora:
            self.lora.use(agent)

    def _grad_shards(self) -> list[torch.Tensor | None]:
        """A copy of this rank's shards of the accumulated gradients."""
        return [
            None if p.grad is None else _local(p.grad).detach().clone()
            for p in self.model.parameters()
        ]

    def _delta_sq(self, before: list[torch.Tensor | None]) -> float:
        """Sum of squares (this rank's shards) of what the gradient gained since `before`."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, old in zip(self.model.parameters(), before):
            if p.grad is None:
                continue
            delta = _local(p.grad).detach().double()
            if old is not None:
                delta = delta - old.double()
            total += delta.square().sum()
        return float(total)

    def _clip(self) -> float:
        """Global gradient norm before clipping; clips in place when grad_clip > 0."""
        max_norm = self.cfg.learner.grad_clip if self.cfg.learner.grad_clip > 0 else math.inf
        if self.lora:
            return self.lora.clip(self.optimizer, max_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        return float(norm)

    def _metrics(
        self,
        shard: BatchShard,
        sums: dict[str, torch.Tensor],
        norms: list[float],
        agent_norms: torch.Tensor,
    ) -> dict[str, float]:
        """Means over the batch's updates: loss per update, token metrics per trained token
        (every token is trained once per epoch), gradient norms per update (pre-clip)."""
        keys = sorted(sums)  # the same on every rank: every rank ran the same micro-batches
        packed = torch.stack([sums[k] for k in keys]).to(self.device)
        dist.all_reduce(packed)
        totals = dict(zip(keys, packed.cpu().tolist()))
        m = self.name
        updates = max(len(norms), 1)
        tokens = max(shard.total_tokens, 1) * self.cfg.learner.ppo_epochs
        finite = [n for n in norms if math.isfinite(n)]
        metrics = {
            f"loss/{m}": totals.pop("loss") / updates,
            # mean over the finite updates, beside the skip count (inf if none was finite)
            f"grad_norm/{m}": sum(finite) / len(finite) if finite else math.inf if norms else 0.0,
            f"grad_norm_max/{m}": max(norms, default=0.0),
            f"updates/{m}": float(len(norms)),
            f"lr/{m}": float(self.optimizer.param_groups[0]["lr"]),
            f"tokens/{m}": float(shard.total_tokens),
            f"samples/{m}": float(shard.total_samples),
        }
        metrics |= {f"{_TOKEN_MEANS[k]}/{m}": v / tokens for k, v in totals.items()}
        if self.cfg.learner.per_agent_grad_norm:
            for agent, norm in zip(self.agents, agent_norms.tolist()):
                metrics[f"agent_grad_norm/{agent}"] = norm
        return metrics

    # ------------------------------------------------------------------ weights out
    def param_specs(self, adapters: Collection[str] | None = None) -> list[TensorSpec]:
        """(HF name, full shape, dtype) of what full_state_dict_iter(dtype=publish_dtype)
        yields, in order (on a LoRA base, of `adapters` only when given); local."""
        if self.lora:
            return self.lora.specs(self.model, self.publish_dtype, adapters)
        return model_io.param_specs(self.model, self.publish_dtype)

    def refuse_non_finite(self, version: int, when: str = "step") -> None:
        """Raise NonFiniteWeights if the weights hold NaN or inf (every rank gets the same
        answer from `non_finite`, so all stop together): after the step to `version`
        ("step"), in the model folder at start ("start") or just before a publish of
        `version` ("publish": the weights came from checked states, so it is a fault)."""
        bad = self.non_finite()
        if not bad:
            return
        where = {
            "step": f"step {version} left NaN or inf in",
            "start": f"the weights in {self.source} hold NaN or inf in",
            "publish": f"v{version} holds NaN or inf, about to be published, in",
        }[when]
        what = {
            "step": f"they are not published to the actors (they keep serving v{version - 1}) "
            f"nor saved. Lower models.{self.name}.lr (or learner.grad_clip) and continue from "
            "the last checkpoint: drmas train run.resume=RUN_DIR ...",
            "start": "nothing was trained or sent: fix or replace that model folder",
            "publish": "not sent to the actors (they keep the version they hold); continue "
            "from the last checkpoint: drmas train run.resume=RUN_DIR ...",
        }[when]
        raise NonFiniteWeights(
            f"{self.name}: {where} {len(bad)} parameter(s) ({describe(bad)}); {what}"
        )

    def weights_out(
        self, device: torch.device | str | None, version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """What a publish of `version` streams (full_state_dict_iter in the publish dtype,
        no copies), the weights checked finite first: every publish, republishes included
        (a collective: every rank must call it)."""
        self.refuse_non_finite(version, "publish")
        return self.full_state_dict_iter(device, self.publish_dtype, copy=False)

    def non_finite(self) -> list[str]:
        """The trainable parameters that hold a NaN or an inf on any rank, by name, sorted
        (a collective: every rank must call it). Non-finite gradients already skip their
        optimizer step; this catches weights that became non-finite anyway (an overflow in
        the update itself), so they are never published or saved as the new version."""
        names = [
            name
            for name, p in self.model.named_parameters()
            if p.requires_grad and not finite(_local(p.detach()))
        ]
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, names)
        return sorted({n for part in gathered for n in part or []})

    def full_state_dict_iter(
        self,
        device: torch.device | str | None = "cpu",
        dtype: torch.dtype | None = None,
        *,
        copy: bool = True,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) per parameter (model_io.full_tensors); on a LoRA base
        every adapter's, sorted by name (a publish sends those of the broker's plan and
        fingerprints them all: AdapterSet.only). A collective: every rank must exhaust it.
        `device` None keeps the tensors where they were gathered; `dtype` None keeps the
        master dtype (checkpoints), else casts (publishing); `copy` False: model_io.full_tensors."""
        if self.lora:
            return self.lora.tensors(self.model, device, dtype)
        return model_io.full_tensors(self.model, device, dtype, copy=copy)

    def save_pretrained(self, out_dir: Path | str) -> None:
        """Collective: gather the weights; rank 0 writes an HF folder (config, weights and
        the source folder's tokenizer files, when it has any); on a LoRA base that of the
        base, and a PEFT folder per adapter in its adapters/ (AdapterSet.save)."""
        if self.lora:
            self.lora.save(self.source, Path(out_dir), self.rank)
            return
        state = {}
        for name, tensor in self.full_state_dict_iter("cpu"):
            if self.rank == 0:
                state[name] = tensor
        if self.rank == 0:
            lm = cast(PreTrainedModel, self.model)  # no adapters: the causal LM itself
            model_io.save_hf_folder(lm, state, self.source, Path(out_dir))
            log.info("saved %s to %s", self.name, out_dir)
        dist.barrier()


class NonFiniteWeights(RuntimeError):
    """An optimizer step left NaN or inf in the model: nothing of it is published or saved."""


def _fused_adam_ok(device: torch.device, model: torch.nn.Module) -> bool | None:
    """True where torch has a fused AdamW for every parameter (CPU or CUDA, float
    dtypes); None (torch's default choice) elsewhere."""
    kinds = {p.dtype for p in model.parameters()}
    floats = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
    return True if device.type in ("cpu", "cuda") and kinds <= floats else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
