"""Checks every decoded message before the broker uses it.

A message that fails raises `ProtocolError("invalid", reason)`; the broker answers with
an ErrorReply, counts it and goes on. Nothing here mutates state, so a refused message
can never half-apply.
"""

from __future__ import annotations

import math
from operator import add
from typing import Any, NoReturn

import msgspec
import numpy as np

from drmas.protocol.arrays import unpack_ids
from drmas.protocol.codec import ProtocolError
from drmas.protocol.messages import (
    MAX_ABS_REWARD,
    Episode,
    GroupResult,
    Hello,
    LeaseRequest,
    Step,
    StepHeader,
    pack_group,
)

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""Where a Hugging Face config.json gives the model's context length (the first present)."""


def context_from_config(data: dict[str, Any]) -> int | None:
    """A model's context length in tokens from its config.json (a multimodal model's
    text_config too), or None when it names none."""
    for source in (data, data.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return None


class Limits(msgspec.Struct):
    """What the broker accepts. Built once from the run's config."""

    agent_models: dict[str, str]  # agent -> model
    vocab_sizes: dict[str, int]  # model -> vocabulary size
    max_prompt_tokens: int = 32_768
    max_response_tokens: int = 32_768
    max_steps_per_episode: int = 64
    max_lease_request: int = 1024
    max_id_chars: int = 256
    contexts: dict[str, int] = {}
    """model -> its context length: a step's prompt + response must fit (models without
    one are held to max_prompt_tokens and max_response_tokens only)."""

    pairs: frozenset[tuple[str, str]] = frozenset()
    """Every (agent, model) pair a step may carry (derived from agent_models)."""
    shared_vocab: int = 0
    """The vocabulary size when every model has the same one, else 0 (derived)."""
    min_context: int = 0
    """The shortest of `contexts` (0: none), for the one-pass check (derived)."""

    def __post_init__(self) -> None:
        self.pairs = frozenset(self.agent_models.items())
        sizes = set(self.vocab_sizes.values())
        self.shared_vocab = sizes.pop() if len(sizes) == 1 else 0
        self.min_context = min(self.contexts.values(), default=0)


def _fail(reason: str) -> NoReturn:
    raise ProtocolError("invalid", reason)


def check_hello(msg: Hello, limits: Limits) -> None:
    if not msg.client_id or len(msg.client_id) > limits.max_id_chars:
        _fail(f"client_id must be 1..{limits.max_id_chars} characters")
    for field, value in (("client_id", msg.client_id), ("host", msg.host)):
        if not value.isprintable():  # a newline would forge a broker log line
            _fail(
                f"{field} {value[:64]!r} holds control characters (newline, tab, escape): "
                "use printable text"
            )
    if len(msg.models) > len(limits.vocab_sizes):
        _fail(f"{len(msg.models)} models named; this run trains {sorted(limits.vocab_sizes)}")
    unknown = sorted(set(msg.models) - set(limits.vocab_sizes))
    if unknown:
        _fail(f"unknown model(s) {unknown}; this run trains {sorted(limits.vocab_sizes)}")
    if msg.role == "learner" and not (0 <= msg.rank < msg.world_size):
        _fail(f"learner rank {msg.rank} outside world size {msg.world_size}")


def check_lease_request(msg: LeaseRequest, limits: Limits) -> None:
    if not (1 <= msg.max_groups <= limits.max_lease_request):
        _fail(f"max_groups must be 1..{limits.max_lease_request}, got {msg.max_groups}")


def check_step(step: Step, limits: Limits) -> None:
    """Validate one Step as the broker would (packed into a one-step group)."""
    try:
        group = pack_group("", 0, 0, [Episode([step], 0.0)])
    except ValueError as exc:
        _fail(str(exc))
    check_group_result(group, limits, 1)


_FINISH_REASONS = frozenset(("stop", "length"))
_U32 = np.dtype("<u4")
_F32 = np.dtype("<f4")


MAX_EPISODE_METRICS = 32
"""Workflow metrics one episode may carry (each becomes a metrics.jsonl column)."""


def _check_episode_metrics(i: int, metrics: dict[str, float]) -> None:
    if len(metrics) > MAX_EPISODE_METRICS:
        _fail(f"episode {i}: {len(metrics)} metrics, at most {MAX_EPISODE_METRICS}")
    for name, value in metrics.items():
        if not (0 < len(name) <= 64) or not math.isfinite(value):
            _fail(
                f"episode {i}: metric {name[:64]!r}={value} needs a 1..64-char name and a finite value"
            )


def check_group_result(msg: GroupResult, limits: Limits, group_size: int) -> None:
    """Validate a columnar group: one cheap combined test over the step headers (the
    broker's hot path; the exact reason only when it fails), then one vectorised test per
    buffer."""
    episodes = msg.episodes
    if len(episodes) != group_size:
        _fail(f"group {msg.group_id} has {len(episodes)} episodes, lease asked {group_size}")
    max_steps = limits.max_steps_per_episode
    headers: list[StepHeader] = []
    for i, episode in enumerate(episodes):
        steps = episode.steps
        if not (1 <= len(steps) <= max_steps):
            _fail(f"episode {i}: {len(steps)} steps outside 1..{max_steps}")
        if not abs(episode.reward) <= MAX_ABS_REWARD:  # NaN fails too
            _fail(
                f"episode {i}: reward {episode.reward} is not finite or beyond ±{MAX_ABS_REWARD:g}"
            )
        if episode.metrics:
            _check_episode_metrics(i, episode.metrics)
        headers += steps
    # one pass per field over every step header (cheaper than one branchy loop per step)
    pairs = {(h.agent, h.model) for h in headers}
    prompt_lens = [h.prompt_len for h in headers]
    response_lens = [h.response_len for h in headers]
    if (
        not pairs <= limits.pairs
        or min(prompt_lens) < 1
        or max(prompt_lens) > limits.max_prompt_tokens
        or min(response_lens) < 1
        or max(response_lens) > limits.max_response_tokens
        or min(h.version for h in headers) < 0
        or not {h.finish_reason for h in headers} <= _FINISH_REASONS
        or any(h.reward is not None and not abs(h.reward) <= MAX_ABS_REWARD for h in headers)
        or (limits.min_context and max(map(add, prompt_lens, response_lens)) > limits.min_context)
    ):
        for i, h in enumerate(headers):
            problem = _step_problem(h, limits)
            if problem:
                _fail(f"step {i}: {problem}")
    total_p, total_r = sum(prompt_lens), sum(response_lens)
    if len(msg.prompt_ids) != 4 * total_p:
        _fail(_bytes_problem("prompt_ids", msg.prompt_ids, total_p))
    if len(msg.response_ids) != 4 * total_r:
        _fail(_bytes_problem("response_ids", msg.response_ids, total_r))
    if len(msg.logprobs) != 4 * total_r:
        _fail(_bytes_problem("logprobs", msg.logprobs, total_r))
    vocab = limits.shared_vocab or _one_vocab(pairs, limits)
    if vocab:
        # the group's models share one vocabulary: one reduction per buffer; read as
        # unsigned, a negative id is >= 2**31 > any vocabulary
        if _max(_u32(msg.prompt_ids)) >= vocab or _max(_u32(msg.response_ids)) >= vocab:
            _fail(_which_ids(msg, limits) or f"a token id is outside 0..{vocab - 1}")
    else:
        _check_ids_per_step(msg, limits)
    values = _f32(msg.logprobs)
    # NaN fails both comparisons; -inf fails the first, anything positive the second
    if not (_min(values) > -math.inf and _max(values) <= 0.0):
        _fail("log-probs must be finite and <= 0")


def _one_vocab(pairs: set[tuple[str, str]], limits: Limits) -> int:
    """The vocabulary size of the group's models if they share one, else 0."""
    sizes = {limits.vocab_sizes[model] for _, model in pairs}
    return sizes.pop() if len(sizes) == 1 else 0


def _bytes_problem(name: str, raw: memoryview, tokens: int) -> str:
    return f"{name} holds {len(raw)} bytes; the step headers say {tokens} tokens (x 4)"


def _u32(raw: memoryview) -> np.ndarray:
    return np.frombuffer(raw, dtype=_U32)


def _f32(raw: memoryview) -> np.ndarray:
    return np.frombuffer(raw, dtype=_F32)


_max, _min = np.maximum.reduce, np.minimum.reduce  # what ndarray.max/min call, minus a layer


def _step_problem(h: StepHeader, limits: Limits) -> str:
    """The first thing wrong with a step header in words, or "" if nothing is."""
    model = limits.agent_models.get(h.agent)
    if model is None:
        return f"unknown agent {h.agent!r}; agents are {sorted(limits.agent_models)}"
    if h.model != model:
        return f"agent {h.agent!r} is bound to model {model!r}, step says {h.model!r}"
    if not (1 <= h.prompt_len <= limits.max_prompt_tokens):
        return f"prompt of {h.prompt_len} tokens outside 1..{limits.max_prompt_tokens}"
    if not (1 <= h.response_len <= limits.max_response_tokens):
        return f"response of {h.response_len} tokens outside 1..{limits.max_response_tokens}"
    context = limits.contexts.get(model)
    if context is not None and h.prompt_len + h.response_len > context:
        return (
            f"prompt of {h.prompt_len} + response of {h.response_len} tokens exceed model "
            f"{model!r}'s context of {context}"
        )
    if h.version < 0:
        return f"negative weight version {h.version}"
    if h.finish_reason not in _FINISH_REASONS:
        return f"finish_reason must be 'stop' or 'length', got {h.finish_reason!r}"
    if h.reward is not None and not abs(h.reward) <= MAX_ABS_REWARD:  # NaN fails too
        return f"step reward {h.reward} is not finite or beyond ±{MAX_ABS_REWARD:g}"
    return ""


def _check_ids_per_step(msg: GroupResult, limits: Limits) -> None:
    """Models of different vocabularies in one group: test each step against its own."""
    problem = _which_ids(msg, limits)
    if problem:
        _fail(problem)


def _which_ids(msg: GroupResult, limits: Limits) -> str:
    """The reason naming the first step and part with an out-of-vocabulary id, or ""."""
    prompts, responses = unpack_ids(msg.prompt_ids), unpack_ids(msg.response_ids)
    p = r = i = 0
    for episode in msg.episodes:
        for h in episode.steps:
            vocab = limits.vocab_sizes[limits.agent_models[h.agent]]
            for name, ids in (
                ("prompt", prompts[p : p + h.prompt_len]),
                ("response", responses[r : r + h.response_len]),
            ):
                if ids.min() < 0 or ids.max() >= vocab:
                    return (
                        f"step {i}: {name} token id outside the vocabulary of {h.model!r} "
                        f"(size {vocab})"
                    )
            p, r, i = p + h.prompt_len, r + h.response_len, i + 1
    return ""
