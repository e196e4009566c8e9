"""Learner settings: loss, optimizer, FSDP ranks. Plain dataclasses (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from drmas.config.types import (
    MAX_GROUP_EPISODES,
    Device,
    ISCorrection,
    LossAgg,
    NonNegative,
    NonNegativeFloat,
    Port,
    Positive,
    PositiveFloat,
    ProbeBaseline,
    Seconds,
)


@dataclass
class LossConfig:
    """PPO clipped surrogate with dual clip and off-policy correction (docs/algorithm.md)."""

    clip_low: NonNegativeFloat = 0.2
    """ε_low: ratio clipped below at 1 - clip_low."""
    clip_high: NonNegativeFloat = 0.2
    """ε_high: ratio clipped above at 1 + clip_high."""
    dual_clip: float = 3.0
    """c of dual-clip PPO (bounds the loss of negative-advantage tokens); <= 1 disables."""
    is_correction: ISCorrection = "tis"
    """tis: weight min(π_old/π_behaviour, is_cap); mask: drop tokens above is_cap; none."""
    is_cap: PositiveFloat = 2.0
    """C of the truncated importance weight."""
    agg: LossAgg = "token-mean"
    """How token losses are averaged into one number."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (0 in the reference math runs)."""
    kl_coef: float = 0.0
    """KL to a frozen reference model (k3 estimator); 0 = no reference model is loaded."""
    max_response_len: Positive = 512
    """Normaliser of seq-mean-token-sum-norm (Dr. GRPO's constant)."""


@dataclass
class LearnerConfig:
    """One learner group per model; these apply to every group unless the model overrides."""

    world_size: Positive = 1
    """FSDP ranks per model (each a process)."""
    micro_batch_size: Positive = 16
    """Sequences per forward/backward on one rank (at most)."""
    micro_batch_tokens: NonNegative = 0
    """Token budget of one forward/backward (0 = none): a micro-batch closes before it
    would exceed it (padded: rows x longest sequence; packed: the sum of lengths), so long
    episodes make smaller micro-batches and memory stays bounded. A longer sequence than
    the budget still runs, alone."""
    pack: bool = False
    """Padding-free micro-batches: the sequences of a micro-batch are concatenated into one
    row whose position ids restart per sequence, and transformers keeps attention within
    each sequence (Hugging Face decoder LMs, which all take position_ids). No compute is
    spent on padding; loss and gradients equal the padded path (tested)."""
    grad_clip: PositiveFloat = 1.0
    """Gradient-norm clip: of the whole model; on a LoRA base, of each adapter on its own
    (one agent's large gradient must not shrink another agent's update)."""
    ppo_minibatches: Positive = 1
    """Optimizer updates per pass over a batch: the batch is split into this many
    mini-batches (the reference's ppo_mini_update_num: 1 in its math recipe, 5 in search).
    With more than one update, π_old is fixed by a no-grad forward pass over the whole
    batch before the first update, so the PPO clip can act."""
    ppo_epochs: Positive = 1
    """Passes over each batch (every pass makes ppo_minibatches updates)."""
    device: Device = "auto"
    """auto: CUDA (NCCL) when available, else CPU (gloo)."""
    threads: NonNegative = 0
    """CPU threads of each learner rank's torch ops. 0 = auto: under `drmas train`, this
    machine's CPUs shared evenly among the learner ranks and actors it starts (at least
    1 each; DRMAS_TORCH_THREADS, when set, wins); a learner started alone keeps torch's
    default. Two learners that each spin 2 threads on 2 cores train 10x slower than with
    1 thread each (measured), so CPU runs must not oversubscribe."""
    timeout_s: Seconds = 300.0
    """Timeout of every collective of the learner group."""
    per_agent_grad_norm: bool = True
    """Measure the gradient norm contributed by each agent (costs one gradient copy)."""
    master_port: Port = 0
    """torch.distributed rendezvous port of the group (0 = free port; drmas train only)."""
    poll_s: Seconds = 0.05
    """Wait between batch requests when the broker has none ready."""


@dataclass
class ProbeConfig:
    """`drmas probe`: Lemma 4.2 measured with the learner's own loss (drmas/learners/probe.py)."""

    rewards: dict[str, Annotated[list[float], Meta(min_length=2, max_length=2)]] = field(
        default_factory=dict
    )
    """Synthetic mode: agent -> [mean, std]; each of its steps scores a normal draw,
    independent of the sampled actions. Empty = sampled mode: the team's real scores."""
    groups: Annotated[int, Meta(ge=2)] = 64
    """Groups to sample (each of group_size episodes, from the training tasks)."""
    group_size: Annotated[int, Meta(ge=0, le=MAX_GROUP_EPISODES)] = 0
    """Episodes per group; 0 = the run's group_size (at most 4096)."""
    seed: int = 0
    """Task draw, engine sampling and synthetic scores."""
    baselines: Annotated[list[ProbeBaseline], Meta(min_length=1)] = field(
        default_factory=lambda: ["global", "step_global"]
    )
    """Advantage modes to compare with agent-wise advantages: the shared baselines (global,
    step_global), the ablations (agent_mean, agent_std, agent_centred, agent_shifted) or
    agent-and-turn (agent_turn)."""
    bootstrap: Positive = 2000
    """Bootstrap resamples of the groups for the 95 % intervals."""
