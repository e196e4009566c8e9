"""Which positions of a micro-batch the learner scores, and their log-probs: called by
drmas/learners/trainer.py (Trainer.token_stats) for every forward pass.

Only the positions that predict response tokens go through the LM head, through the
model's own `logits_to_keep` (a start position on a padded micro-batch, the exact
positions on a packed one): on a chat prompt as long as its reply, that halves the head's
matmul and the [tokens, vocabulary] log-softmax, forward and backward. The results are put
back into the padded [B, L-1] frame, zero where nothing is scored, so the loss code never
knows. A model whose forward has no `logits_to_keep` gets every position, as before.
"""

from __future__ import annotations

import torch

from drmas.learners.batching import MicroBatch
from drmas.learners.loss import token_logprobs_and_entropy


def token_stats(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    with_entropy: bool,
    keep: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs of mb.targets (and entropy) at `temperature`, in the padded
    [B, L-1] frame, 0 where nothing is scored; `keep`: the model takes logits_to_keep.
    A packed micro-batch runs the model on its one padding-free row and gathers the
    results back into that frame."""
    if mb.packed is None:
        start = first_scored(mb.mask) if keep else 0
        extra = {"logits_to_keep": mb.input_ids.shape[1] - start} if keep else {}
        out = model(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False, **extra
        )  # logits of positions start..L-1
        logprobs, entropy = token_logprobs_and_entropy(
            out.logits[:, :-1], mb.targets[:, start:], temperature, with_entropy
        )  # [B, L-1-start]
        return _left_pad(logprobs, start), None if entropy is None else _left_pad(entropy, start)
    packed = mb.packed
    width = packed.input_ids.shape[1] - 1  # the packed shifted frame [1, N-1]
    if keep:
        scored = packed.index[mb.mask > 0]  # [K] sorted: rows are packed in order
        if not len(scored):  # nothing scored (an all-masked micro-batch): one position
            scored = torch.zeros(1, dtype=torch.int64, device=packed.index.device)
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            use_cache=False,
            logits_to_keep=scored,
        )
        logprobs, entropy = token_logprobs_and_entropy(
            out.logits, packed.input_ids[:, scored + 1], temperature, with_entropy
        )  # [1, K]
        logprobs = _scatter(logprobs, scored, width)
        entropy = None if entropy is None else _scatter(entropy, scored, width)
    else:
        out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)
        logprobs, entropy = token_logprobs_and_entropy(
            out.logits[:, :-1], packed.input_ids[:, 1:], temperature, with_entropy
        )  # [1, N-1]
    return packed.unpack(logprobs), None if entropy is None else packed.unpack(entropy)


def first_scored(mask: torch.Tensor) -> int:
    """The first position of the shifted [B, L-1] frame that any row scores (mask > 0);
    the last position when none does, so the forward still yields one logit per row."""
    scored = (mask > 0).any(0)  # [L-1]
    if not bool(scored.any()):
        return mask.shape[1] - 1
    return int(scored.to(torch.int8).argmax())


def _left_pad(values: torch.Tensor, start: int) -> torch.Tensor:
    """[B, T] values of positions start.. -> the [B, start + T] frame, zeros before."""
    return torch.nn.functional.pad(values, (start, 0)) if start else values


def _scatter(values: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    """[1, K] values at `positions` of a [1, width] frame -> that frame, zeros elsewhere."""
    full = values.new_zeros((1, width))
    return full.index_put((torch.zeros_like(positions), positions), values[0])
