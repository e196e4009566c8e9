"""The engine side of the interface every rollout engine implements (hf, vllm, sglang,
sim): the interface itself, `Engine` with its request and result types, is declared in
drmas/protocol/engine.py, where the teams that call it find it without importing the
actor; here is what every engine does with a request before queueing it.
"""

from __future__ import annotations

import dataclasses

from drmas.protocol.engine import Engine, GenerateRequest, GenerateResult

__all__ = ["Engine", "GenerateRequest", "GenerateResult", "check_request", "fit_context"]


def check_request(request: GenerateRequest, vocab_size: int) -> None:
    """The checks every engine makes before queueing a request (ValueError says which)."""
    if not request.prompt_ids:
        raise ValueError("empty prompt")
    if request.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {request.max_new_tokens}")
    if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab_size:
        raise ValueError(f"prompt token id outside the vocabulary [0, {vocab_size})")


def fit_context(request: GenerateRequest, context: int | None) -> GenerateRequest:
    """`request` within a model's `context` (prompt + response tokens; None: no limit):
    max_new_tokens cut to what is left after the prompt (the response then ends with
    finish_reason "length"), ValueError for a prompt that leaves no room. The broker refuses
    steps longer than their model's context, so an engine never generates one."""
    if context is None:
        return request
    room = context - len(request.prompt_ids)
    if room < 1:
        raise ValueError(
            f"a prompt of {len(request.prompt_ids)} tokens leaves no room in the model's "
            f"context of {context}: shorten the team's prompts (fewer turns or shorter "
            "documents) or use a model with a longer context"
        )
    if request.max_new_tokens > room:
        return dataclasses.replace(request, max_new_tokens=room)
    return request
