"""Fixtures shared by the unit and the integration tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private builtin-model cache for the whole session: each builtin model (the tiny
    ones per warm-start setting, SmolLM2 built from its GGUF file) is built once, by the
    first test that needs it."""
    return tmp_path_factory.mktemp("drmas-cache")
