"""The hf engine's running batch (drmas/actors/engines/hf.py): its rows and their tensors,
all aligned on the batch axis, and the tensor helpers its continuous batching uses
(left-padding a cache to merge two batches, which caches can be edited so, top-p)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from drmas.actors.engines.scheduler import Row

if TYPE_CHECKING:
    from transformers import DynamicCache


@dataclass(eq=False)
class Batch:
    """The running rows and their tensors, all aligned on the batch axis."""

    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor
    """[B, cache_len] long: 1 where the row attends (left padding is 0)."""
    next_pos: torch.Tensor
    """[B] long: position id of the token each row feeds next."""
    last: torch.Tensor
    """[B] long: the token each row feeds next (its latest sample)."""
    temperature: torch.Tensor
    """[B] float32."""
    top_p: torch.Tensor
    """[B] float32."""

    @property
    def all_greedy(self) -> bool:
        return all(row.request.temperature <= 0 for row in self.rows)

    @property
    def any_top_p(self) -> bool:
        return any(row.request.top_p < 1 for row in self.rows)


def is_plain_layer(layer: Any) -> bool:
    """Merging and trimming edit keys/values directly: only full-attention dynamic layers
    (no sliding window, no quantisation) store exactly [B, heads, seq, dim]."""
    from transformers.cache_utils import DynamicLayer

    return type(layer) is DynamicLayer


def pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (per row; rows
    with top_p >= 1 keep everything, even where rounding lifts the cumulative sum past 1)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    limit = torch.where(top_p >= 1, torch.full_like(top_p, float("inf")), top_p)
    sorted_probs = sorted_probs.masked_fill(mass_before >= limit[:, None], 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
