"""Checkpoint settings. Plain dataclasses (no torch import)."""

from __future__ import annotations

from dataclasses import dataclass

from drmas.config.types import NonNegative, Positive


@dataclass
class CheckpointConfig:
    """When and where learners and the broker save a resumable state."""

    every: NonNegative = 0
    """Save every this many optimizer steps of each model (0 = never; the end always)."""
    keep: Positive = 2
    """Complete checkpoints kept per model (older ones are deleted after a newer one is complete)."""
    dir: str = ""
    """Where checkpoints go; empty = RUN_DIR/checkpoints."""
