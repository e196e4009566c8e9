"""DRMAS_TORCH_THREADS: the torch CPU threads of one drmas process.

`drmas train` sets it for every learner rank and actor it starts (its share of the
machine's CPUs, drmas/launch/train.py); a user may set it for any role. Read here, once,
with a clear error for a value that is not a whole number >= 1.
"""

from __future__ import annotations

import os

VARIABLE = "DRMAS_TORCH_THREADS"
CPU_SHARE = "DRMAS_CPU_SHARE"
"""The folder where the processes of an asynchronous CPU run lend each other idle CPUs
(drmas/cpu_share.py); set by `drmas train`."""


def env_threads() -> int | None:
    """The thread count DRMAS_TORCH_THREADS asks for, or None when it is not set."""
    raw = os.environ.get(VARIABLE, "").strip()
    if not raw:
        return None
    try:
        threads = int(raw)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(
            f"{VARIABLE}={raw!r}: set it to a whole number of threads >= 1, or unset it"
        )
    return threads
