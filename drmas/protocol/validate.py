"""Checks every decoded message before the broker uses it.

A message that fails raises `ProtocolError("invalid", reason)`; the broker answers with
an ErrorReply, counts it and goes on. Nothing here mutates state, so a refused message
can never half-apply.
"""

from __future__ import annotations

import math
from typing import NoReturn

import msgspec
import numpy as np

from drmas.protocol.arrays import unpack_ids, unpack_logprobs
from drmas.protocol.codec import ProtocolError
from drmas.protocol.messages import GroupResult, Hello, LeaseRequest, Step


class Limits(msgspec.Struct):
    """What the broker accepts. Built once from the run's config."""

    agent_models: dict[str, str]  # agent -> model
    vocab_sizes: dict[str, int]  # model -> vocabulary size
    max_prompt_tokens: int = 32_768
    max_response_tokens: int = 32_768
    max_steps_per_episode: int = 64
    max_lease_request: int = 1024
    max_id_chars: int = 256


def _fail(reason: str) -> NoReturn:
    raise ProtocolError("invalid", reason)


def check_hello(msg: Hello, limits: Limits) -> None:
    if not msg.client_id or len(msg.client_id) > limits.max_id_chars:
        _fail(f"client_id must be 1..{limits.max_id_chars} characters")
    unknown = sorted(set(msg.models) - set(limits.vocab_sizes))
    if unknown:
        _fail(f"unknown model(s) {unknown}; this run trains {sorted(limits.vocab_sizes)}")
    if msg.role == "learner" and not (0 <= msg.rank < msg.world_size):
        _fail(f"learner rank {msg.rank} outside world size {msg.world_size}")


def check_lease_request(msg: LeaseRequest, limits: Limits) -> None:
    if not (1 <= msg.max_groups <= limits.max_lease_request):
        _fail(f"max_groups must be 1..{limits.max_lease_request}, got {msg.max_groups}")


def check_step(step: Step, limits: Limits) -> None:
    check_steps([step], limits)


def check_steps(steps: list[Step], limits: Limits) -> None:
    """Validate many steps: one cheap combined test per step (the broker's hot path), the
    exact reason only when it fails, then one vectorised pass over all ids and log-probs."""
    agent_models = limits.agent_models
    max_p, max_r = 4 * limits.max_prompt_tokens, 4 * limits.max_response_tokens
    ids_by_model: dict[str, list[bytes]] = {}
    logprobs: list[bytes] = []
    for step in steps:
        model = agent_models.get(step.agent)
        p, r = len(step.prompt_ids), len(step.response_ids)
        if (
            model is None
            or step.model != model
            or (p | r) & 3
            or not (4 <= p <= max_p and 4 <= r <= max_r)
            or len(step.logprobs) != r
            or step.version < 0
            or step.finish_reason not in _FINISH_REASONS
        ):
            _fail(_step_problem(step, limits))
        chunks = ids_by_model.get(model)
        if chunks is None:
            chunks = ids_by_model[model] = []
        chunks += (step.prompt_ids, step.response_ids)
        logprobs.append(step.logprobs)
    for model, chunks in ids_by_model.items():
        ids = unpack_ids(b"".join(chunks))
        vocab = limits.vocab_sizes[model]
        if ids.min() < 0 or ids.max() >= vocab:
            _fail(_which_ids(steps, limits, model, vocab))
    values = unpack_logprobs(b"".join(logprobs))
    if not np.isfinite(values).all() or values.max() > 0.0:
        _fail("log-probs must be finite and <= 0")


_FINISH_REASONS = frozenset(("stop", "length"))


def _step_problem(step: Step, limits: Limits) -> str:
    """The first thing wrong with a step that failed the fast test, in words."""
    model = limits.agent_models.get(step.agent)
    if model is None:
        return f"unknown agent {step.agent!r}; agents are {sorted(limits.agent_models)}"
    if step.model != model:
        return f"agent {step.agent!r} is bound to model {model!r}, step says {step.model!r}"
    p, r, lp = len(step.prompt_ids), len(step.response_ids), len(step.logprobs)
    for what, size in (("prompt id", p), ("response id", r), ("log-prob", lp)):
        if size % 4:
            return f"{what} buffer of {size} bytes is not a multiple of 4"
    if not (1 <= p // 4 <= limits.max_prompt_tokens):
        return f"prompt of {p // 4} tokens outside 1..{limits.max_prompt_tokens}"
    if not (1 <= r // 4 <= limits.max_response_tokens):
        return f"response of {r // 4} tokens outside 1..{limits.max_response_tokens}"
    if lp != r:
        return f"{lp // 4} log-probs for {r // 4} response tokens"
    if step.version < 0:
        return f"negative weight version {step.version}"
    return f"finish_reason must be 'stop' or 'length', got {step.finish_reason!r}"


def check_group_result(msg: GroupResult, limits: Limits, group_size: int) -> None:
    if len(msg.episodes) != group_size:
        _fail(f"group {msg.group_id} has {len(msg.episodes)} episodes, lease asked {group_size}")
    for i, episode in enumerate(msg.episodes):
        if not math.isfinite(episode.reward):
            _fail(f"episode {i}: reward is not finite")
        if not (1 <= len(episode.steps) <= limits.max_steps_per_episode):
            _fail(
                f"episode {i}: {len(episode.steps)} steps outside 1..{limits.max_steps_per_episode}"
            )
    check_steps([step for episode in msg.episodes for step in episode.steps], limits)


def _which_ids(steps: list[Step], limits: Limits, model: str, vocab: int) -> str:
    """The refusal reason naming the first step and part with an out-of-vocabulary id."""
    for i, step in enumerate(steps):
        if limits.agent_models[step.agent] != model:
            continue
        for name, raw in (("prompt", step.prompt_ids), ("response", step.response_ids)):
            ids = unpack_ids(raw)
            if ids.min() < 0 or ids.max() >= vocab:
                return (
                    f"step {i}: {name} token id outside the vocabulary of {model!r} (size {vocab})"
                )
    return f"a token id is outside the vocabulary of {model!r} (size {vocab})"
