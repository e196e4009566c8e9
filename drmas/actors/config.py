"""Actor settings: engine, sampling, workflow. Plain dataclasses (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

EngineName = Literal["hf", "vllm", "sglang", "sim"]


@dataclass
class EngineConfig:
    """One inference engine per model pool on the actor."""

    name: str = "hf"
    """Which engine serves the pool."""
    max_batch: int = 64
    """Sequences decoded together."""
    device: str = "auto"
    """auto: CUDA when available."""
    dtype: str = "float32"
    """Inference dtype."""
    seed: int = 0
    """Sampling seed; each actor adds a hash of its id, so actors sample independently."""
    sim_token_latency_s: float = 0.005
    """sim engine: seconds one decode step takes, for the whole running batch at once."""
    sim_prompt_latency_s_per_token: float = 0.00002
    """sim engine: prefill seconds per prompt token admitted (summed over the admitted batch)."""
    sim_stop_prob: float = 0.02
    """sim engine: chance that a sampled token is EOS (finish_reason "stop")."""
    sim_vocab_size: int = 0
    """sim engine: sample token ids below this; 0 (or more than the model has) = the model's
    whole vocabulary."""


@dataclass
class SamplingConfig:
    """Training-time sampling (validation has its own in ValConfig)."""

    temperature: float = 1.0
    """Softmax temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 256
    """Response length cap per agent call."""


@dataclass
class WorkflowConfig:
    """The multi-agent workflow an episode runs."""

    name: str = "math"
    """math: Solver <-> Verifier."""
    max_loops: int = 2
    """Solver/Verifier rounds; the Verifier is skipped on the last one."""
    prompt_style: str = "plain"
    """plain text prompts (tiny models) or the tokenizer's chat template."""
    instructions: dict[str, str] | None = None
    """Per-agent role instruction; None = the workflow's own."""


@dataclass
class ActorConfig:
    """One actor process: engines for the models it serves, running leased groups."""

    id: str = ""
    """Unique name; empty = host-pid."""
    num_actors: int = 1
    """drmas train: actor processes to start."""
    models: list[str] | None = None
    """Models this actor serves; None = all of the run's models."""
    max_groups: int = 8
    """Leased groups held at once (their episodes are batched together)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Engine of every pool on this actor."""
