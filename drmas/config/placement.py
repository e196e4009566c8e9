"""GPU placement of the processes `drmas train` starts on one node (planned by
drmas/launch/placement.py). Plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from msgspec import Meta

from drmas.config.types import Fraction, ShareMode


@dataclass
class PlacementConfig:
    """GPU placement of the processes `drmas train` starts on this node."""

    gpus: Annotated[int, Meta(ge=-1)] = -1
    """GPUs to place on; -1 = every CUDA device torch sees. 0 (or none found, or
    learner.device=cpu with CPU engines) = a CPU run: nothing is placed."""
    share: ShareMode = "auto"
    """auto: actors get GPUs of their own when enough are left after one per learner
    rank, else they share the learners'; exclusive: refuse to share; shared: always put
    actors on the learners' GPUs (a one-GPU node, or to keep GPUs free)."""
    learners: dict[str, list[int]] = field(default_factory=dict)
    """Explicit: model -> one GPU index per learner rank (models not listed: automatic)."""
    actors: dict[str, list[int]] = field(default_factory=dict)
    """Explicit: actor index ("0", "1", ...) -> the GPUs its engines use."""
    learner_memory: Fraction = 0.5
    """On a GPU that a learner rank shares with engines: the fraction of memory kept for
    the learner; the engines' gpu_memory_utilization there must sum to at most the rest."""
