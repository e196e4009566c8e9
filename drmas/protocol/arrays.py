"""Raw little-endian arrays for token ids and log-probs on the wire.

Token ids travel as int32 and log-probs as float32 bytes, never as lists of Python
numbers: a 256-token step is 2 KB of bytes instead of 256 boxed objects.
Imports nothing of the project (protocol rule).
"""

from __future__ import annotations

import numpy as np

IDS_DTYPE = np.dtype("<i4")
LOGPROBS_DTYPE = np.dtype("<f4")


def pack_ids(ids: object) -> bytes:
    """Token ids (list, numpy array or torch tensor on CPU) -> int32 LE bytes."""
    return np.asarray(ids, dtype=IDS_DTYPE).tobytes()


def unpack_ids(raw: bytes | memoryview) -> np.ndarray:
    """int32 LE bytes -> read-only [n] int32 array (zero copy)."""
    if len(raw) % IDS_DTYPE.itemsize:
        raise ValueError(f"token id buffer of {len(raw)} bytes is not a multiple of 4")
    return np.frombuffer(raw, dtype=IDS_DTYPE)


def pack_logprobs(values: object) -> bytes:
    """Per-token log-probs -> float32 LE bytes."""
    return np.asarray(values, dtype=LOGPROBS_DTYPE).tobytes()


def unpack_logprobs(raw: bytes | memoryview) -> np.ndarray:
    """float32 LE bytes -> read-only [n] float32 array (zero copy)."""
    if len(raw) % LOGPROBS_DTYPE.itemsize:
        raise ValueError(f"log-prob buffer of {len(raw)} bytes is not a multiple of 4")
    return np.frombuffer(raw, dtype=LOGPROBS_DTYPE)
