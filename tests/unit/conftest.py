"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.rendezvous import gloo_init


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo process group for the test (learner code that runs collectives),
    torn down after it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=gloo_init(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
