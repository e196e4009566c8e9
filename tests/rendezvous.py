"""A gloo rendezvous for tests that start process groups themselves: a file store in the
temp folder. No port is picked and released first, so nothing else on the machine (a broker
or engine another test started) can take it between the pick and the bind."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path


def gloo_init() -> str:
    """An `init_method` for `dist.init_process_group` that no other group shares."""
    return (Path(tempfile.gettempdir()) / f"drmas-test-gloo-{uuid.uuid4().hex}").as_uri()
