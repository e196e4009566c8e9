"""What travels inside a weight group, and in which order: the header learner rank 0 sends
first (bucket size, then name, shape and dtype of every tensor) and the bucket layout both
sides derive from it with the same pure function, `plan_buckets`, so that no per-bucket
metadata travels. The receiver checks a header (`decode_header`) before allocating
anything from it. No sockets and no process groups here (group.py has those).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec
import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]

MAX_HEADER_BYTES = 64 * 2**20
"""A header (name, shape, dtype of every tensor) longer than this is refused unread."""
MAX_BUCKET_BYTES = 8 * 2**30
"""A bucket size rank 0 may announce (weights.bucket_mb is far below it). A receiver
allocates at most the bytes the header's tensors add up to, whatever it announces."""
DIGEST_BYTES = 32
"""Length of the digest trailer (hex characters of drmas.transports.digest)."""
NONCE_BYTES = 16
"""Length of rank 0's token challenge (group.py: Group.authenticate)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a tensor may be published in, by the name the header carries."""
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class WeightSyncError(RuntimeError):
    """A weight group failed (peer gone, backend mismatch, bad header). `absent`, at rank 0
    of a rendezvous that failed: the ranks whose entry never came (the group's own ranks;
    WeightSender.publish turns them into the plan's), empty when that is not known."""

    absent: tuple[int, ...] = ()


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight-group wait ran out of time; the message names group, phase and peers."""


class TensorSpec(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of the header: HF parameter name, shape, dtype name ("bfloat16")."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


class Header(msgspec.Struct, array_like=True, frozen=True):
    """rank 0 -> ranks 1..n, first thing in a group: layout of everything that follows."""

    bucket_bytes: int
    tensors: list[TensorSpec]
    digest: bool = False
    """A digest of every byte sent follows the last bucket (DIGEST_BYTES, uint8): the
    receiver compares it with what it received before anything goes live."""


@dataclass(frozen=True)
class Bucket:
    """One broadcast: a flat tensor of `dtype` holding `members` (spec index, offset, numel)."""

    dtype: str
    members: tuple[tuple[int, int, int], ...]

    @property
    def numel(self) -> int:
        _, offset, numel = self.members[-1]
        return offset + numel

    @property
    def last(self) -> int:
        return self.members[-1][0]


def spec_of(name: str, tensor: torch.Tensor) -> TensorSpec:
    if tensor.dtype not in DTYPE_NAMES:
        raise ValueError(f"{name}: dtype {tensor.dtype} cannot be published")
    return TensorSpec(name, tuple(int(d) for d in tensor.shape), DTYPE_NAMES[tensor.dtype])


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[Bucket]:
    """Pack tensors, in order, into one open bucket per dtype; a bucket closes when the next
    tensor of its dtype would overflow it (a tensor bigger than a bucket gets its own).
    Buckets are returned in send order: by the index of their last member, which is when the
    streaming sender has all of a bucket. Pure, so sender and receivers agree exactly."""
    done: list[Bucket] = []
    open_: dict[str, tuple[list[tuple[int, int, int]], int]] = {}  # dtype -> (members, bytes)
    for i, spec in enumerate(specs):
        members, used = open_.get(spec.dtype, ([], 0))
        if members and used + spec.nbytes > bucket_bytes:
            done.append(Bucket(spec.dtype, tuple(members)))
            members, used = [], 0
        offset = members[-1][1] + members[-1][2] if members else 0
        members.append((i, offset, spec.numel))
        open_[spec.dtype] = (members, used + spec.nbytes)
    done.extend(Bucket(dtype, tuple(members)) for dtype, (members, _) in open_.items() if members)
    return sorted(done, key=lambda b: b.last)


def encode_header(header: Header, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The header as the two tensors rank 0 broadcasts: its length (int64 [1]), its bytes."""
    raw = msgspec.msgpack.encode(header)
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    return torch.tensor([len(raw)], dtype=torch.int64, device=device), payload


def decode_header(raw: bytes, group: str) -> Header:
    """The header rank 0 sent, checked before anything is allocated from it."""
    try:
        header = msgspec.msgpack.decode(raw, type=Header)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WeightSyncError(f"weight group {group!r}: bad header: {exc}") from None
    if not (0 < header.bucket_bytes <= MAX_BUCKET_BYTES):
        raise WeightSyncError(
            f"weight group {group!r}: bucket of {header.bucket_bytes} bytes announced "
            f"(at most {MAX_BUCKET_BYTES})"
        )
    for spec in header.tensors:
        if (
            spec.dtype not in DTYPES
            or any(d < 0 for d in spec.shape)
            or spec.nbytes > MAX_BUCKET_BYTES
        ):
            raise WeightSyncError(
                f"weight group {group!r}: tensor {spec.name[:100]!r} has dtype {spec.dtype[:20]!r} "
                f"and shape {spec.shape[:8]}: a known dtype, sizes >= 0 and at most "
                f"{MAX_BUCKET_BYTES} bytes expected"
            )
    return header


FLOATS = frozenset({"float32", "bfloat16", "float16", "float64"})
"""A floating tensor may arrive in any of these (the publish dtype may differ from the
engine's; the engine casts on copy). Any other dtype must match exactly."""


@dataclass(frozen=True)
class Expected:
    """What a receiver must get before it loads a byte: exactly these tensors (name ->
    shape and dtype name of the engine's own tensor), each once, nothing else. `what`
    names the set for the error message ("every parameter of m", "adapters a, b").

    With `group_of` (name -> its group, e.g. the LoRA adapter a parameter belongs to) a
    header may carry any set of whole groups instead: every tensor of each group it
    touches, none of a group partly."""

    specs: Mapping[str, tuple[tuple[int, ...], str]]
    what: str
    group_of: Callable[[str], str] | None = None


def header_bytes(header: Header) -> int:
    """What the header's tensors add up to: the most a receiver ever allocates for them."""
    return sum(spec.nbytes for spec in header.tensors)


def check_covers(header: Header, expected: Expected, group: str) -> None:
    """Refuse a header that does not name exactly `expected` (a partial header would leave
    the rest of the model at the previous version, an extra name would write where it
    must not), or whose shapes or dtypes differ. Runs before any bucket is received."""
    names = [spec.name for spec in header.tensors]
    required = set(expected.specs)
    if expected.group_of is not None:
        group_of = expected.group_of
        touched = {group_of(n) for n in names if n in expected.specs}
        required = {n for n in expected.specs if group_of(n) in touched}
    missing = sorted(required - set(names))
    extra = sorted(set(names) - set(expected.specs))
    if missing or extra or len(names) != len(set(names)):
        raise WeightSyncError(
            f"weight group {group!r}: the header names {len(names)} tensors, "
            f"{len(required)} expected ({expected.what}): missing {len(missing)} "
            f"{_few(missing)}, unknown {len(extra)} {_few(extra)}, "
            f"repeated {len(names) - len(set(names))}; refusing it before loading anything"
        )
    for spec in header.tensors:
        shape, dtype = expected.specs[spec.name]
        same_kind = spec.dtype == dtype or (spec.dtype in FLOATS and dtype in FLOATS)
        if tuple(spec.shape) != tuple(shape) or not same_kind:
            raise WeightSyncError(
                f"weight group {group!r}: tensor {spec.name[:100]!r} announced as "
                f"{spec.dtype} {tuple(spec.shape)[:8]}, the engine holds {dtype} "
                f"{tuple(shape)[:8]}; refusing the header before loading anything"
            )


def _few(names: Sequence[str]) -> str:
    return "(" + ", ".join(repr(n[:80]) for n in names[:3]) + (", ...)" if len(names) > 3 else ")")


def expected_of(named: Iterable[tuple[str, torch.Tensor]], what: str) -> Expected:
    """The expectation for these (name, tensor) pairs: the engine's own tensors."""
    specs = {}
    for name, tensor in named:
        dtype = DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
        specs[name] = (tuple(int(d) for d in tensor.shape), dtype)
    return Expected(specs, what)
