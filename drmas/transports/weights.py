"""New weights from learner rank 0 to the actors serving a model, over torch.distributed.

A *weight group* per membership: learner rank 0 is rank 0, the actors of the broker's
WeightGroupPlan are ranks 1..n. The group is built directly from a `TCPStore` that learner
rank 0 hosts for the whole run (bound on `WeightSyncConfig.host`, free port), namespaced
by `PrefixStore(group_name)`, so it never touches the learners' own default group.

The group persists across versions: the broker names a publish's group after its
membership (drmas/broker/publishing.py), and while the name (and, on the actor side, the
store and rank) stays the same, sender and receivers broadcast the next version over the
group they already hold, with no rendezvous and no teardown. A new name (an actor
attached, detached or failed, a re-publish to a subset, a restarted learner) retires the
old group: it is aborted (never waits for a peer) by `release()`, off the sync's path,
since gloo's teardown holds the GIL for ~20 ms. A failed publish aborts its group at
once, so the next one forms a fresh group. A dead or late peer never leaves a hung group.

Protocol inside a group (all broadcasts from rank 0):

    store  "<group>/backend" = "gloo" | "nccl"   (set before the rendezvous)
    1. header length      int64 [1]
    2. header             uint8 [length]  msgpack Header: bucket_bytes + (name, shape, dtype)
    3. bucket 0 .. n-1    one flat tensor of a single dtype each, in `plan_buckets` order

Both sides compute the bucket layout with the same pure function `plan_buckets` from the
header, so no per-bucket metadata travels. Rank 0 streams: it pulls one gathered tensor at
a time, copies it into the open bucket of its dtype and starts broadcasting a bucket as
soon as its last member is in, filling the next one while it travels (receivers likewise
receive the next bucket while `load` copies the current one). Memory beyond the model:
at most two reusable bucket buffers per dtype on each side; a tensor larger than a
bucket travels alone, without a copy on the sender.

Every wait (store connect, rendezvous, each broadcast) has the group's timeout; running
out raises WeightSyncTimeout naming the group, the phase and the peers.

Exposure: the store listens only on `weights.host` (rank 0 binds the socket itself and
hands it to torch, which would otherwise listen on every interface); anyone who reaches it
can read and write its keys, so weights.host should be an address only the actors reach.
gloo's own pair sockets listen on the interface it picks from the host name (set
GLOO_SOCKET_IFNAME to pin it); docs/security.md has the firewall recipe. A receiver takes
at most MAX_HEADER_BYTES of header and MAX_BUCKET_BYTES per bucket from rank 0.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import logging
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from drmas.config.transport import WeightSyncConfig
from drmas.protocol.messages import JoinWeightGroup

log = logging.getLogger("drmas.weights")

NamedTensors = Iterable[tuple[str, torch.Tensor]]

MAX_HEADER_BYTES = 64 * 2**20
"""A header (name, shape, dtype of every tensor) longer than this is refused unread."""
MAX_BUCKET_BYTES = 8 * 2**30
"""A bucket size rank 0 may announce (weights.bucket_mb is far below it)."""

_DTYPES: dict[str, torch.dtype] = {
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
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


class WeightSyncError(RuntimeError):
    """A weight group failed (peer gone, backend mismatch, bad header)."""


class WeightSyncTimeout(WeightSyncError, TimeoutError):
    """A weight-group wait ran out of time; the message names group, phase and peers."""


# ------------------------------------------------------------------------- layout
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
        return self.numel * torch.empty((), dtype=_DTYPES[self.dtype]).element_size()


class Header(msgspec.Struct, array_like=True, frozen=True):
    """rank 0 -> ranks 1..n, first thing in a group: layout of everything that follows."""

    bucket_bytes: int
    tensors: list[TensorSpec]


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
    if tensor.dtype not in _DTYPE_NAMES:
        raise ValueError(f"{name}: dtype {tensor.dtype} cannot be published")
    return TensorSpec(name, tuple(int(d) for d in tensor.shape), _DTYPE_NAMES[tensor.dtype])


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


# ------------------------------------------------------------------------- groups
def resolve_backend(cfg: WeightSyncConfig, device: torch.device | str) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class _Where:
    """What a weight-group error message names: group, own rank, peers, timeout."""

    group: str
    rank: int
    world_size: int
    timeout_s: float
    peers: str

    @property
    def timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.timeout_s)

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """Re-raise a torch.distributed failure (a RuntimeError) as WeightSyncTimeout when it
        ran out of time, else WeightSyncError, naming the group, phase and peers."""
        start = time.monotonic()
        try:
            yield
        except WeightSyncError:
            raise
        except (RuntimeError, ValueError) as exc:
            waited = time.monotonic() - start
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            timed_out = "timeout" in text.lower() or "timed out" in text.lower()
            cls = WeightSyncTimeout if timed_out else WeightSyncError
            raise cls(
                f"weight group {self.group!r} (rank {self.rank} of {self.world_size}): "
                f"{what} failed after {waited:.1f}s (timeout {self.timeout_s:.0f}s); "
                f"peers: {self.peers}; cause: {text}"
            ) from exc


class _Group:
    """A process group built from a store for one publish; every wait is bounded."""

    def __init__(
        self, where: _Where, store: dist.Store, backend: str, device: torch.device
    ) -> None:
        self.where = where
        self.device = device
        with where.phase("rendezvous"):
            self.pg: Any = _make_pg(
                store, where.rank, where.world_size, backend, device, where.timeout
            )

    def start(self, tensor: torch.Tensor, what: str) -> Any:
        """Queue a broadcast from rank 0 (gloo runs it on its own threads); `finish` waits."""
        assert self.pg is not None
        with self.where.phase(what):
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.timeout = self.where.timeout
            return self.pg.broadcast([tensor], opts)

    def finish(self, work: Any, what: str) -> None:
        with self.where.phase(what):
            work.wait(self.where.timeout)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.finish(self.start(tensor, what), what)

    def close(self, ok: bool) -> None:
        """Tear the group down: shutdown when every peer is known to be doing the same, else
        abort (never waits for a peer). Either costs ~20 ms holding the GIL (gloo joins its
        threads), which is why groups are retired and closed later by `release()`."""
        if self.pg is None:
            return
        pg, self.pg = self.pg, None
        try:
            if ok:
                pg.shutdown()
            else:
                pg.abort()
        except RuntimeError as exc:  # already broken: nothing left to release
            log.debug("closing weight group %s: %s", self.where.group, exc)


class _Retired:
    """Groups that are no longer used and only wait to be torn down, off the sync's path."""

    def __init__(self) -> None:
        self.groups: list[_Group] = []

    def add(self, group: _Group) -> None:
        self.groups.append(group)

    def release(self) -> None:
        # abort: a retired group's peers may be gone (that is often why it was retired)
        while self.groups:
            self.groups.pop().close(ok=False)


def _make_pg(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    device: torch.device,
    timeout: datetime.timedelta,
) -> dist.ProcessGroupGloo | dist.ProcessGroupNCCL:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        if device.type != "cuda":
            raise WeightSyncError(f"backend nccl needs a CUDA device, got {device}")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        # NCCL connects lazily; connect now so the rendezvous phase is where it fails.
        pg.eager_connect_single_device(device)
        return pg
    raise WeightSyncError(f"unknown weight-sync backend {backend!r}: use gloo or nccl")


def _encode_header(header: Header, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    raw = msgspec.msgpack.encode(header)
    payload = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    return torch.tensor([len(raw)], dtype=torch.int64, device=device), payload


class _Buffers:
    """Flat bucket buffers of `bucket_bytes`, kept per dtype (two at most: one in flight,
    one filling) and reused across buckets and versions: fresh ones would cost a page fault
    per 4 KiB on every publish. A bucket bigger than that (one big tensor) gets a tensor of
    its own, never kept. Every buffer made here stays referenced until dropped from
    `owned`, so no foreign tensor can ever share an address with one and be taken in."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.free: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.owned: dict[int, torch.Tensor] = {}  # data_ptr -> buffer

    def take(self, dtype: str, numel: int, bucket_bytes: int) -> torch.Tensor:
        torch_dtype = _DTYPES[dtype]
        capacity = bucket_bytes // torch.empty((), dtype=torch_dtype).element_size()
        if numel > capacity:
            return torch.empty(numel, dtype=torch_dtype, device=self.device)
        free = self.free.setdefault((torch_dtype, capacity), [])
        if free:
            return free.pop()[:numel]
        buffer = torch.empty(capacity, dtype=torch_dtype, device=self.device)
        self.owned[buffer.data_ptr()] = buffer
        return buffer[:numel]

    def give(self, view: torch.Tensor, bucket_bytes: int) -> None:
        buffer = self.owned.get(view.data_ptr())
        if buffer is None:
            return
        free = self.free.setdefault((buffer.dtype, bucket_bytes // buffer.element_size()), [])
        if len(free) < 2:
            free.append(buffer)
        else:
            del self.owned[buffer.data_ptr()]

    def reset(self) -> None:
        """After a failure: forget every buffer (some may still be under an aborted op)."""
        self.free.clear()
        self.owned.clear()


class _Pipeline:
    """Broadcasts in flight, oldest first: at most one waits while the next bucket is filled
    (sender) or loaded (receiver), so copying overlaps the transfer."""

    def __init__(self, group: _Group, on_done: Callable[[torch.Tensor], None]) -> None:
        self.group = group
        self.on_done = on_done
        self.inflight: collections.deque[tuple[Any, str, torch.Tensor]] = collections.deque()

    def push(self, tensor: torch.Tensor, what: str) -> None:
        self.inflight.append((self.group.start(tensor, what), what, tensor))

    def pop(self) -> torch.Tensor:
        work, what, tensor = self.inflight.popleft()
        self.group.finish(work, what)
        self.on_done(tensor)
        return tensor

    def drain(self, keep: int = 0) -> None:
        while len(self.inflight) > keep:
            self.pop()


# ------------------------------------------------------------------------- sender
@dataclass
class PublishStats:
    seconds: float
    bytes: int
    buckets: int
    reused: bool = False
    """Sent over the group of the previous publish (same members): no rendezvous."""


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
            spec.dtype not in _DTYPES
            or any(d < 0 for d in spec.shape)
            or spec.nbytes > MAX_BUCKET_BYTES
        ):
            raise WeightSyncError(
                f"weight group {group!r}: tensor {spec.name[:100]!r} has dtype {spec.dtype[:20]!r} "
                f"and shape {spec.shape[:8]}: a known dtype, sizes >= 0 and at most "
                f"{MAX_BUCKET_BYTES} bytes expected"
            )
    return header


def _listen(host: str) -> tuple[int, int]:
    """A listening TCP socket on `host` only (free port): (port, fd handed to torch)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    return port, sock.detach()


def advertised_host(host: str, broker_address: str) -> str:
    """The address actors reach this learner's weight store at. "auto": the local address
    of the interface that routes to the broker (actors reach the broker, and on a cluster
    the learner's address on that network is what they can reach too)."""
    if host != "auto":
        return host
    target = broker_address.split("//")[-1].rsplit(":", 1)[0].strip("[]") or "127.0.0.1"
    if target in ("*", "0.0.0.0", "localhost"):
        target = "127.0.0.1"
    import socket

    family = socket.AF_INET6 if ":" in target else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))  # UDP connect sends nothing; it only picks a route
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise OSError(
            f"weights.host=auto could not find a route to the broker host {target!r} ({exc}); "
            "set weights.host to this learner's address that actors can reach"
        ) from None


class WeightSender:
    """Learner rank 0: hosts the run's weight store and broadcasts each new version."""

    def __init__(
        self, cfg: WeightSyncConfig, device: torch.device | str = "cpu", broker_address: str = ""
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.backend = resolve_backend(cfg, self.device)
        self.host = advertised_host(cfg.host, broker_address)
        # The store lives for the whole run; each publish namespaces it by group name.
        port, fd = _listen(self.host)
        self.store = dist.TCPStore(
            self.host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            master_listen_fd=fd,  # torch owns (and closes) the socket from here
        )
        self._retired = _Retired()
        self._buffers = _Buffers(self.device)
        self._live: tuple[str, _Group] | None = None  # (group name, group) kept for the next

    @property
    def store_address(self) -> str:
        return f"{self.host}:{self.store.port}"

    def release(self) -> None:
        """Tear down retired groups (~20 ms each, holding the GIL); call it when a stall does
        not matter (the learner does after PublishDone). The next publish calls it too."""
        self._retired.release()

    def close(self) -> None:
        """The end of the run: the group kept for the next publish is torn down too."""
        if self._live is not None:
            self._retired.add(self._live[1])
            self._live = None
        self._retired.release()

    def _group(self, name: str, where: _Where) -> tuple[_Group, bool]:
        """The group kept from the previous publish when `name` is its name; else a new one
        (the kept one is retired)."""
        if self._live is not None and self._live[0] == name:
            group = self._live[1]
            if group.where.world_size == where.world_size:
                group.where = where
                return group, True
        if self._live is not None:
            self._retired.add(self._live[1])
            self._live = None
            self._retired.release()  # before the new rendezvous: at most one group at a time
        store = dist.PrefixStore(name, self.store)
        store.set("backend", self.backend)
        return _Group(where, store, self.backend, self.device), False

    def publish(
        self,
        group_name: str,
        world_size: int,
        named_tensors: NamedTensors,
        timeout_s: float,
        *,
        specs: Sequence[TensorSpec] | None = None,
        peers: Sequence[str] = (),
    ) -> PublishStats:
        """Broadcast `named_tensors` to ranks 1..world_size-1 of group `group_name`: the
        group of the previous publish when the name is the same, else a new one.

        `specs` (name, shape, dtype of every tensor, in order) lets the header go out before
        the first tensor is gathered; without it the tensors are materialised first.
        Raises WeightSyncTimeout/WeightSyncError and aborts the group; a group that went
        through is kept for the next publish.
        """
        self.release()
        start = time.monotonic()
        if specs is None:
            materialised = list(named_tensors)
            specs = [spec_of(n, t) for n, t in materialised]
            named_tensors = materialised
        header = Header(int(self.cfg.bucket_mb * 2**20), list(specs))
        buckets = plan_buckets(header.tensors, header.bucket_bytes)
        who = ", ".join(peers) if peers else f"ranks 1..{world_size - 1}"
        group, reused = self._group(group_name, _Where(group_name, 0, world_size, timeout_s, who))
        try:
            length, payload = _encode_header(header, self.device)
            group.broadcast(length, "header length")
            group.broadcast(payload, "header")
            sent = self._stream(group, header, buckets, named_tensors)
        except BaseException:
            group.close(ok=False)
            self._live = None
            self._buffers.reset()
            raise
        self._live = (group_name, group)
        stats = PublishStats(time.monotonic() - start, sent, len(buckets), reused)
        log.info(
            "published %s: %.1f MB in %d buckets to %s in %.2fs (%s group)",
            group_name, sent / 1e6, stats.buckets, who, stats.seconds,
            "kept" if reused else "new",
        )  # fmt: skip
        return stats

    def _stream(
        self,
        group: _Group,
        header: Header,
        buckets: Sequence[Bucket],
        named_tensors: NamedTensors,
    ) -> int:
        """Copy tensors into their buckets as they arrive; send each bucket once complete."""
        specs = header.tensors
        where = {i: (b, off) for b, bucket in enumerate(buckets) for i, off, _ in bucket.members}
        pipeline = _Pipeline(group, lambda t: self._buffers.give(t, header.bucket_bytes))
        filling: dict[int, torch.Tensor] = {}
        next_bucket, sent, count = 0, 0, 0
        for i, (name, tensor) in enumerate(named_tensors):
            if i >= len(specs) or spec_of(name, tensor) != specs[i]:
                got = spec_of(name, tensor)
                raise WeightSyncError(f"tensor {i} is {got}, header said {specs[i : i + 1]}")
            b, offset = where[i]
            bucket = buckets[b]
            flat = tensor.detach().reshape(-1).to(self.device)
            if len(bucket.members) == 1:
                filling[b] = flat.contiguous()  # one tensor: send it as is, no copy
            else:
                if b not in filling:
                    filling[b] = self._buffers.take(bucket.dtype, bucket.numel, header.bucket_bytes)
                filling[b][offset : offset + flat.numel()].copy_(flat)
            count += 1
            while next_bucket < len(buckets) and buckets[next_bucket].last < count:
                data = filling.pop(next_bucket)
                pipeline.push(data, f"bucket {next_bucket} of {len(buckets)}")
                pipeline.drain(keep=1)
                sent += data.numel() * data.element_size()
                next_bucket += 1
        pipeline.drain()
        if count != len(specs):
            raise WeightSyncError(f"got {count} tensors, header announced {len(specs)}")
        return sent


# ------------------------------------------------------------------------- receiver
@dataclass
class ReceiveStats:
    seconds: float
    bytes: int
    buckets: int
    tensors: int


class WeightReceiver:
    """Actor side: joins the group a JoinWeightGroup names and receives one version."""

    def __init__(
        self, cfg: WeightSyncConfig | None = None, device: torch.device | str = "cpu"
    ) -> None:
        self.cfg = cfg or WeightSyncConfig()
        self.device = torch.device(device)
        self.backend = resolve_backend(self.cfg, self.device)
        self._retired = _Retired()
        self._buffers = _Buffers(self.device)
        # model -> ((group name, store address, rank, world size), group) kept for the next
        self._live: dict[str, tuple[tuple[str, str, int, int], _Group]] = {}

    def release(self) -> None:
        """Tear down retired groups (~20 ms each, holding the GIL); call it once generation
        has resumed. The next receive calls it too."""
        self._retired.release()

    def close(self) -> None:
        """The actor stops: the groups kept for the next versions are torn down too."""
        for _, group in self._live.values():
            self._retired.add(group)
        self._live.clear()
        self._retired.release()

    def kept(self, model: str) -> str:
        """Name of the group kept for `model` ("" when none)."""
        live = self._live.get(model)
        return live[0][0] if live else ""

    def _group(self, join: JoinWeightGroup, where: _Where) -> _Group:
        """The group kept from the previous version of this model when the join names the
        same group, store and rank; else a new one (the kept one is retired)."""
        key = (join.group_name, join.store_address, join.rank, join.world_size)
        live = self._live.pop(join.model, None)
        if live is not None and live[0] == key:
            live[1].where = where
            return live[1]
        if live is not None:
            self._retired.add(live[1])
            self._retired.release()
        with where.phase("connecting to the weight store"):
            host, port = join.store_address.rsplit(":", 1)
            client = dist.TCPStore(
                host, int(port), is_master=False, timeout=where.timeout, wait_for_workers=False
            )
            store = dist.PrefixStore(join.group_name, client)
            backend = store.get("backend").decode()
        if backend != self.backend:
            raise WeightSyncError(
                f"weight group {join.group_name!r}: learner broadcasts over {backend}, this "
                f"actor resolved {self.backend} (device {self.device}); set weights.backend"
            )
        return _Group(where, store, backend, self.device)

    def receive_into(
        self, join: JoinWeightGroup, load: Callable[[NamedTensors], None]
    ) -> ReceiveStats:
        """Receive every bucket and call `load` once per bucket with (HF name, tensor) views
        into it. The views are only valid during that call (the buffer is reused for a later
        bucket): `load` copies them into the model, as Engine.load_weights does."""
        start = time.monotonic()
        nbytes = buckets = tensors = 0
        for batch in self._buckets(join):
            load(batch)
            buckets += 1
            tensors += len(batch)
            nbytes += sum(t.numel() * t.element_size() for _, t in batch)
        return ReceiveStats(time.monotonic() - start, nbytes, buckets, tensors)

    def receive(self, join: JoinWeightGroup) -> Iterator[tuple[str, torch.Tensor]]:
        """Same as receive_into, as a flat generator; consume it fully (or close it). A tensor
        is valid until the generator moves past the end of its bucket."""
        for batch in self._buckets(join):
            yield from batch

    def _buckets(self, join: JoinWeightGroup) -> Iterator[list[tuple[str, torch.Tensor]]]:
        self.release()
        peer = f"learner rank 0 of {join.model} at {join.store_address}"
        where = _Where(join.group_name, join.rank, join.world_size, join.timeout_s, peer)
        group = self._group(join, where)
        try:
            header = self._header(group)
            plan = plan_buckets(header.tensors, header.bucket_bytes)
            pipeline = _Pipeline(group, lambda t: None)
            if plan:
                self._post(pipeline, plan, 0, header)
            for b, bucket in enumerate(plan):
                if b + 1 < len(plan):
                    self._post(pipeline, plan, b + 1, header)  # arrives while b is loaded
                flat = pipeline.pop()
                yield [
                    (header.tensors[i].name, flat[off : off + n].view(header.tensors[i].shape))
                    for i, off, n in bucket.members
                ]
                self._buffers.give(flat, header.bucket_bytes)
        except BaseException:  # includes GeneratorExit: the caller stopped early
            group.close(ok=False)
            self._buffers.reset()
            raise
        self._live[join.model] = (
            (join.group_name, join.store_address, join.rank, join.world_size),
            group,
        )

    def _post(self, pipeline: _Pipeline, plan: list[Bucket], b: int, header: Header) -> None:
        buffer = self._buffers.take(plan[b].dtype, plan[b].numel, header.bucket_bytes)
        pipeline.push(buffer, f"bucket {b} of {len(plan)}")

    def _header(self, group: _Group) -> Header:
        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        group.broadcast(length, "header length")
        size = int(length.item())
        if not (0 < size <= MAX_HEADER_BYTES):
            raise WeightSyncError(
                f"weight group {group.where.group!r}: rank 0 announces a header of {size} "
                f"bytes (at most {MAX_HEADER_BYTES}); not allocating it"
            )
        payload = torch.empty(size, dtype=torch.uint8, device=self.device)
        group.broadcast(payload, "header")
        return decode_header(payload.cpu().numpy().tobytes(), group.where.group)
