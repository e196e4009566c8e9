"""Model settings: where the checkpoint is and how to optimise it. Plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from drmas.config.types import (
    Fraction,
    NonNegative,
    NonNegativeFloat,
    Positive,
    PositiveFloat,
    Precision,
)

WARMSTART_WORKFLOWS = ("math", "search", "search_queries")


@dataclass
class WarmStartConfig:
    """Supervised warm start of a builtin model, so RL starts between reward 0 and 1."""

    steps: NonNegative = 2000
    """Supervised steps on generated transcripts (0 = none)."""
    batch_size: Positive = 8
    """Transcripts per step."""
    lr: NonNegativeFloat = 1.5e-3
    """AdamW learning rate of the warm start."""
    seed: int = 0
    """Added to the transcripts' own seed: another initialisation and transcript stream,
    hence another warm-started model (seed studies vary it with the task and sampling
    seeds). 0 keeps the default model and its cache key."""
    workflow: str = "math"
    """Which transcripts it trains on: math | search (every search-team agent) |
    search_queries (the Search Agent's calls only) | package.module:SOURCE (your own
    team's drmas.models.warmstart.TranscriptSource). The defaults above are math's; a
    search run sets its own steps, batch_size and lr."""


@dataclass
class LoraConfig:
    """LoRA adapters on a frozen base: each agent bound to the model trains its own adapter
    (agents.<name>.adapter; agents naming the same adapter share it). rank 0 = none: the
    whole model trains (full fine-tuning)."""

    rank: NonNegative = 0
    """r of every adapter of this base; 0 = no adapters, the whole model trains."""
    alpha: PositiveFloat = 16.0
    """LoRA scaling numerator: an adapter's update is (alpha / rank) * B @ A."""
    dropout: Fraction = 0.0
    """Dropout on an adapter's input (training only)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Names of the linear layers that get adapters (peft's target_modules)."""
    init_seed: int = 0
    """Seed of the adapters' initial A matrices, so learners and engines start from the
    same adapters (B starts at zero, so every adapter starts as the base model)."""
    export_merged: bool = False
    """At the end of a run also write RUN_DIR/models/<model>/merged/<adapter>/: the base
    with that adapter merged in, a plain Hugging Face folder any tool loads without peft
    (a whole model's size per adapter)."""


@dataclass
class ModelConfig:
    """One trainable policy; agents bind to it by name."""

    path: str = "builtin:tiny-qwen2"
    """A Hugging Face causal-LM folder, a Hub id org/name (downloaded into the Hugging Face
    cache by the launcher; HF_HUB_OFFLINE=1 uses the cache only), or builtin:<name>
    (created and cached on first use)."""
    revision: str = ""
    """Hub ids only: branch, tag or commit ("" = main)."""
    lr: NonNegativeFloat = 1e-6
    """AdamW learning rate."""
    weight_decay: NonNegativeFloat = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    world_size: Positive | None = None
    """FSDP ranks of this model's learner group; None = learner.world_size."""
    precision: Precision = "fp32"
    """How the learner holds and computes the weights:
    - fp32: fp32 weights, optimizer state and compute (the CPU default);
    - bf16-mixed: fp32 master weights and optimizer state, bf16 forward/backward, gradients
      reduced in fp32 (FSDP2's MixedPrecisionPolicy); what GPU runs should use. Actors
      receive bf16 copies of the weights;
    - bf16-pure: the weights themselves in bf16 (half the memory). AdamW updates smaller
      than bf16's resolution (~0.4 % of a weight) are lost, so at lr ~1e-6 most weights
      never move; kept for memory experiments, with a warning."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward instead of storing them
    (less memory for ~1/3 more compute)."""
    dtype: str = ""
    """Removed (it meant bf16-pure for bfloat16): set `precision` instead."""
    warmstart: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Builtin models only."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Adapters per agent on this model as a frozen base (lora.rank > 0; docs/lora.md)."""


def weights_dtype(precision: str) -> str:
    """The dtype a model's learner publishes its weights in (the engines' compute dtype)."""
    return "float32" if precision == "fp32" else "bfloat16"
