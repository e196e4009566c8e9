"""Weight-sync settings (learner rank 0 -> actors). Plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WeightSyncConfig:
    """How new weights reach the actors."""

    bucket_mb: float = 8.0
    """Parameters are flattened into buckets of about this many MiB per broadcast."""
    timeout_s: float = 60.0
    """Every rendezvous and broadcast of the weight group times out after this."""
    backend: str = "auto"
    """auto: nccl when the learner is on CUDA, else gloo."""
    host: str = "127.0.0.1"
    """Address the learner's weight-group store binds and advertises."""
    verify_digest: bool = True
    """Fingerprint weights on both sides of every publish; the broker compares them."""
