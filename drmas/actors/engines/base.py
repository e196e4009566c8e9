"""The engine side of the interface every rollout engine implements (hf, vllm, sglang,
sim): the interface itself, `Engine` with its request and result types, is declared in
drmas/protocol/engine.py, where the teams that call it find it without importing the
actor; here is what every engine does with a request before queueing it.
"""

from __future__ import annotations

from drmas.protocol.engine import Engine, GenerateRequest, GenerateResult

__all__ = ["Engine", "GenerateRequest", "GenerateResult", "check_request"]


def check_request(request: GenerateRequest, vocab_size: int) -> None:
    """The checks every engine makes before queueing a request (ValueError says which)."""
    if not request.prompt_ids:
        raise ValueError("empty prompt")
    if request.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {request.max_new_tokens}")
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token id outside the vocabulary [0, {vocab_size})")
