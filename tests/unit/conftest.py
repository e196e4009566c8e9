"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from drmas.transports.ports import free_port


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo process group for the test (learner code that runs collectives),
    torn down after it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
