"""Where drmas keeps what it builds once and reuses: builtin models, the synthetic
knowledge base's corpus, retrieval indexes. $DRMAS_CACHE, else ~/.cache/drmas."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    return Path(os.environ.get("DRMAS_CACHE") or Path.home() / ".cache" / "drmas")
