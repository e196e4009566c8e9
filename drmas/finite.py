"""Finite weights only: the one check every place that makes weights live runs.

Learners before a publish or a save (drmas/learners/trainer.py) and after loading a
checkpoint (drmas/learners/checkpoint.py); actors before a received version goes live
(drmas/transports/weights/receiver.py, for every engine that loads through it, and each
engine's own workers: vLLM, SGLang). A NaN that reaches an engine fails generation much
later, with a message that blames the team's code.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def finite(tensor: torch.Tensor) -> bool:
    """No NaN and no inf in `tensor`: its min and max are finite (both propagate a NaN).
    One pass without a [numel] bool tensor: 0.02 s for SmolLM2's 538 MB on a CPU core,
    where isfinite(t).all() took 0.8 s. Integer tensors are always finite."""
    if tensor.numel() == 0 or not (tensor.is_floating_point() or tensor.is_complex()):
        return True
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    low, high = torch.aminmax(tensor.reshape(-1))
    return bool(torch.isfinite(low) & torch.isfinite(high))


def non_finite_names(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names whose tensors hold NaN or inf, in the order given."""
    return [name for name, tensor in named if not finite(tensor)]


def describe(names: list[str], limit: int = 3) -> str:
    """'a, b, c, ... (N)' for an error message."""
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
