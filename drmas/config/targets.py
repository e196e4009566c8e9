"""Target strings (package.module:Name or path/to/file.py:Name) as paths: pure string
work, so the config loader can make file targets absolute without importing anything."""

from __future__ import annotations

import os
from pathlib import Path


def is_file_target(target: str) -> bool:
    path, _, _ = target.rpartition(":")
    return path.endswith(".py")


def absolute_target(target: str, base: str | Path) -> str:
    """`file.py:Name` with the file made absolute against `base`; other targets as given."""
    if not target or not is_file_target(target):
        return target
    path, _, name = target.rpartition(":")
    resolved = (Path(base) / os.path.expanduser(path)).resolve()
    return f"{resolved}:{name}"
