"""The in-process contract between a team's workflow and a rollout engine.

Who calls it: workflows (drmas/teams) call `generate` from many episode coroutines at
once; the engine (drmas/actors/engines: hf, vllm, sglang, sim) batches whatever is
pending. The actor process (drmas/actors/main.py) calls `pause`, `load_weights` and
`resume` when the broker tells it to join a weight group (the tensors arrive through
drmas/transports/weights). Declared here, beside the wire messages, so that teams and
engines both depend on it and not on each other. Imports nothing of drmas.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    temperature: float
    top_p: float
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the decoded response contains one (kept in output)."""
    adapter: str = ""
    """The LoRA adapter to generate with ("" = the model itself: the base of a LoRA model,
    or a fully fine-tuned model). An engine refuses an adapter its model lacks (sim, which
    has no model, ignores it)."""


@dataclass
class GenerateResult:
    token_ids: list[int]
    """Sampled response tokens (EOS included when it ended the sequence)."""
    logprobs: list[float]
    """log softmax(logits / temperature) of each sampled token (before top-p), <= 0."""
    finish_reason: str
    """"stop" (EOS or stop string) or "length" (max_new_tokens)."""
    version: int
    """Weight version when this request started generating."""


class Engine(Protocol):
    """Batched async generation plus weight loading for one model."""

    model_name: str
    version: int
    tokenizer: Any  # the model's Hugging Face tokenizer (workflows build prompts with it)

    async def start(self) -> None:
        """Load the model and start the scheduling loop."""

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        """Queue one request; resolves when it finishes. Safe to call concurrently."""
        ...

    async def pause(self) -> None:
        """Reach a safe point (between decode steps) and hold; in-flight requests keep
        their state and continue after resume (vLLM's "keep" mode)."""

    async def resume(self) -> None:
        """Continue after pause."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy received tensors (Hugging Face parameter names) into the model; call only
        while paused. Sets `version`."""

    def weights_digest(self) -> str:
        """drmas.transports.digest fingerprint of the weights the engine generates with
        ("" if the engine cannot read them back); compared by the broker with the learner's."""
        ...

    async def close(self) -> None:
        """Stop the loop; pending requests fail with RuntimeError."""
