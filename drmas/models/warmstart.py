"""Supervised warm start of a builtin model on one team's generated transcripts.

A team's transcripts module (math_transcripts, search_transcripts) supplies a
`TranscriptSource`: how to draw a batch of (prompt, response) pairs and how to report what
the trained model can do. This module owns what every team shares: batching with a shared
prompt prefix, the response-only loss and the optimiser loop.
"""

from __future__ import annotations

import inspect
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from drmas.config.model import WarmStartConfig

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger("drmas.models")

Pairs = list[tuple[str, str]]
"""(prompt, response) of agent calls; the response starts with a space, EOS is added."""


@dataclass(frozen=True)
class TranscriptSource:
    """One team's warm-start data."""

    seed: int
    """Seeds the model's initialisation and the transcript stream."""
    spec: Any
    """A frozen dataclass of everything that determines the transcripts (in the cache key)."""
    instructions: dict[str, str]
    """The tiny instructions the prompts start with (in the cache key)."""
    draw: Callable[[random.Random, int, float], Pairs]
    """A batch of `n` transcripts from the stream `rng` at `progress` = step / steps (a
    team may change its mix over the warm start: a curriculum)."""
    report: Callable[[Any, Any], None]
    """Logs the trained model's accuracy (model, tokenizer); must not touch the weights."""
    tokenizer: str = "char"
    """The builtin model's tokenizer (drmas/models/vocab.py): char | words."""
    tokenizer_corpus: Callable[[], Iterable[str]] | None = None
    """`words` only: the texts its merges are learned from (deterministic)."""
    vocab_size: int = 0
    """`words` only: the most tokens in all (specials and characters included)."""


def transcript_batch(
    tokenizer: PreTrainedTokenizerBase, pairs: Pairs
) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(shared prefix ids, right-padded suffix ids, suffix labels).

    The prefix is what every prompt of the batch starts with ("Solve.\nQuestion: "); the
    labels are -100 except on the response tokens and the closing EOS. Right padding needs
    no attention mask: under the causal mask no real token sees the pads after it."""
    import torch

    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False).input_ids
    responses = tokenizer([r for _, r in pairs], add_special_tokens=False).input_ids
    # Keep at least one prompt token per row: it predicts the first response token.
    limit, shared = min(map(len, prompts)) - 1, 0
    while shared < limit and all(p[shared] == prompts[0][shared] for p in prompts):
        shared += 1
    rows = [p[shared:] + r + [tokenizer.eos_token_id] for p, r in zip(prompts, responses)]
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prompt, row) in enumerate(zip(prompts, rows)):
        ids[i, : len(row)] = torch.tensor(row)
        first = len(prompt) - shared
        labels[i, first : len(row)] = ids[i, first : len(row)]
    return prompts[0][:shared], ids, labels


def response_loss(
    model: PreTrainedModel, prefix: list[int], ids: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy on the labelled tokens. The shared prefix runs once and its KV
    cache is broadcast over the batch (gradients flow through it): a third less compute
    for the short Solver transcripts."""
    import torch
    import torch.nn.functional as F
    from transformers import DynamicCache

    batch, width = ids.shape
    cache = None
    if prefix:
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([prefix]), use_cache=True, **{_cache_kwarg(model): cache})
        layers: list[Any] = list(cache.layers)
        for layer in layers:
            layer.keys = layer.keys.expand(batch, -1, -1, -1)
            layer.values = layer.values.expand(batch, -1, -1, -1)
    positions = torch.arange(len(prefix), len(prefix) + width).expand(batch, -1)
    logits = model(
        input_ids=ids,
        position_ids=positions,
        use_cache=cache is not None,
        **{_cache_kwarg(model): cache},
    ).logits[:, :-1]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _cache_kwarg(model: PreTrainedModel) -> str:
    """transformers 5 renames `past_key_values` to `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: WarmStartConfig,
    source: TranscriptSource,
) -> None:
    """AdamW on response tokens only; short warm-up, then linear decay to zero.

    Small batches and many steps: the math model has to memorise most of the 800 sums and
    differences, and that depends on the number of updates more than on the number of
    transcripts (batch 8 x 2000 steps reaches ~85 % greedy where 32 x 800 reaches ~40 %
    in the same time). Weight decay and the final low-lr phase are what make the
    accuracy jump late in training."""
    import torch

    rng = random.Random(source.seed + cfg.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.98)
    )
    warmup = max(1, min(20, cfg.steps // 10))

    def lr_at(step: int) -> float:
        if step < warmup:
            return cfg.lr * (step + 1) / warmup
        return cfg.lr * (cfg.steps - step) / (cfg.steps - warmup)

    model.train()
    start = time.perf_counter()
    for step in range(cfg.steps):
        loss = response_loss(
            model, *transcript_batch(tokenizer, source.draw(rng, cfg.batch_size, step / cfg.steps))
        )
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % max(1, cfg.steps // 10) == 0 or step == cfg.steps - 1:
            log.info(
                "warm start step %d/%d loss %.4f (%.1f s)",
                step + 1,
                cfg.steps,
                loss.item(),
                time.perf_counter() - start,
            )
    model.eval()
    source.report(model, tokenizer)


def sampling_kwargs(temperature: float) -> dict[str, Any]:
    """`generate` arguments: greedy at temperature 0, else plain sampling (no top-k/p)."""
    if temperature > 0:
        return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    return {"do_sample": False}


def generate(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    temperature: float,
    seed: int,
    max_new_tokens: int,
) -> list[str]:
    """Completions of `prompts` (left-padded batch), without the prompt and special tokens."""
    import torch

    batch = tokenizer(prompts, add_special_tokens=False, padding=True, return_tensors="pt")
    with torch.random.fork_rng(), torch.inference_mode():
        torch.manual_seed(seed)
        out = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling_kwargs(temperature),
        )
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
