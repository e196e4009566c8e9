"""The torch.distributed side of a weight group: the store learner rank 0 hosts, the
process group built from it (rendezvous, bounded broadcasts, teardown), and the bucket
buffers and broadcast pipeline that sender.py and receiver.py share.

A group is made directly from a `TCPStore` namespaced by `PrefixStore(group_name)`, so it
never touches the learners' own default group. Every wait (store connect, rendezvous, each
broadcast) has the group's timeout; running out raises WeightSyncTimeout naming the
group, the phase and the peers. Closing a group costs ~20 ms holding the GIL (gloo joins
its threads), which is why groups that are no longer used are retired and closed later,
off the sync's path (`Retired`).

Exposure: `listen` binds the store's socket on `weights.host` only (torch would otherwise
listen on every interface); anyone who reaches it can read and write its keys, so
weights.host should be an address only the actors reach. Reaching it is not enough to get
weights or a rank: with a token, every rendezvous entry is signed (`SignedStore`), and
`Group.authenticate` has every rank prove the group's token, through the store, before
rank 0 sends; rank 0 never receives over gloo, and a member receives from rank 0 only
(gloo aborts a process that receives more than it posted: see `Group`).
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hmac
import logging
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from drmas.config.transport import WeightSyncConfig
from drmas.transports.weights.layout import (
    DTYPES,
    NONCE_BYTES,
    WeightSyncError,
    WeightSyncTimeout,
)
from drmas.transports.weights.membership import (
    ROLL_POLL_S,
    SignedStore,
    proof_key,
    token_proof,
)

log = logging.getLogger("drmas.weights")


def resolve_backend(cfg: WeightSyncConfig, device: torch.device | str) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


@dataclass
class Where:
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


class Group:
    """A process group built from a store for one publish; every wait is bounded.

    Over gloo, a "broadcast" is rank 0 sending to each member in turn and each member
    receiving from rank 0 only, never gloo's own broadcast: that one forwards along a tree,
    so a member receives from other members, and a member that forwards more bytes than the
    receive it lands in was posted for makes gloo abort the receiving process (an
    enforce in gloo's I/O thread, not an exception). A receive posted for rank 0 matches
    nothing another member sends, so a bad member can fail a publish but never end a
    process. NCCL (GPU) keeps its broadcast: it does not abort on a size it did not expect,
    and what it delivers is checked against the digest as always."""

    def __init__(
        self,
        where: Where,
        store: dist.Store,
        backend: str,
        device: torch.device,
        token: str = "",
        rendezvous_s: float = 0.0,
    ) -> None:
        """`rendezvous_s` (> 0, with a token): how long the rendezvous and the token proofs
        wait for a peer's entry, when shorter than the group's timeout (rank 0 after a
        roll call: every member checked in and forms the group at once, so one that does
        not is not coming)."""
        self.where = where
        self.device = device
        self.star = backend == "gloo"
        self._tag = 0  # p2p tag of the next star "broadcast", the same count on every rank
        if token:  # every rendezvous entry signed: a store client cannot take a rank
            wait = min(rendezvous_s, where.timeout_s) if rendezvous_s > 0 else where.timeout_s
            timeout = datetime.timedelta(seconds=wait)
            store = SignedStore(store, token, where.group, timeout, watch_abort=where.rank > 0)
        self.store = store  # the token proofs go through it (authenticate)
        try:
            with where.phase("rendezvous"):
                self.pg: Any = make_pg(
                    store, where.rank, where.world_size, backend, device, where.timeout
                )
        except WeightSyncError as exc:
            if isinstance(store, SignedStore) and where.rank == 0:
                exc.absent = _rank_of(store.missing, where.world_size)
                store.abort()
            raise

    def start(self, tensor: torch.Tensor, what: str) -> Any:
        """Queue a broadcast from rank 0 (gloo runs it on its own threads); `finish` waits."""
        assert self.pg is not None
        with self.where.phase(what):
            if self.star:
                tag, self._tag = self._tag, self._tag + 1
                if self.where.rank != 0:
                    return self.pg.recv([tensor], 0, tag)
                return _AllSent(
                    [self.pg.send([tensor], r, tag) for r in range(1, self.where.world_size)]
                )
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.timeout = self.where.timeout
            return self.pg.broadcast([tensor], opts)

    def finish(self, work: Any, what: str) -> None:
        with self.where.phase(what):
            work.wait(self.where.timeout)

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        self.finish(self.start(tensor, what), what)

    def authenticate(self, token: str) -> None:
        """Before any weights go out: rank 0 broadcasts a fresh nonce over the group, every
        rank writes an HMAC of it under the group's token (handed out by the broker to the
        group's members only) to the store, and rank 0 checks every answer there. A peer
        that took a rank's place in the group without the token gets the nonce but cannot
        answer it, and the member it displaced never sees it: the publish fails, sending
        nothing. The answers go through the store, not the group, because rank 0 must
        never receive over gloo from a peer it has not verified: a message larger than the
        receive it lands in makes gloo abort the whole process. Fresh per publish, so a kept
        group proves itself again and no answer replays."""
        where = self.where
        nonce = torch.zeros(NONCE_BYTES, dtype=torch.uint8)
        if where.rank == 0:
            nonce = torch.frombuffer(bytearray(secrets.token_bytes(NONCE_BYTES)), dtype=torch.uint8)
        nonce = nonce.to(self.device)
        self.broadcast(nonce, "token challenge")
        raw = nonce.cpu().numpy().tobytes()
        if where.rank != 0:
            proof = token_proof(token, where.group, where.rank, raw).hex()
            self.store.set(proof_key(where.rank), proof)
            return
        with where.phase("token proofs"):
            bad = self._check_proofs(token, raw)
        if bad:
            raise WeightSyncError(
                f"weight group {where.group!r}: rank(s) {bad} did not prove the group's token: "
                f"a peer that is not a member of the broker's plan took their place (peers: "
                f"{where.peers}); no weights sent. Keep weights.host reachable by actors only"
            )

    def _check_proofs(self, token: str, nonce: bytes) -> list[int]:
        """Rank 0: the ranks whose answer to `nonce` in the store is still wrong after the
        group's timeout (a wrong one may be a store client's, overwritten by the member's)."""
        where = self.where
        waiting = set(range(1, where.world_size))
        deadline = time.monotonic() + where.timeout.total_seconds()
        with contextlib.suppress(RuntimeError):  # DistStoreError: one never answered
            self.store.wait([proof_key(rank) for rank in sorted(waiting)], where.timeout)
        while waiting:
            for rank in sorted(waiting):
                if not self.store.check([proof_key(rank)]):
                    continue
                answer = bytes(self.store.get(proof_key(rank)))
                expected = token_proof(token, where.group, rank, nonce).hex().encode()
                if hmac.compare_digest(answer, expected):
                    waiting.discard(rank)
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(ROLL_POLL_S)
        return sorted(waiting)

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


class _AllSent:
    """Rank 0's sends of one star broadcast, waited for as one: within one timeout in all."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> bool:
        deadline = time.monotonic() + timeout.total_seconds()
        for work in self.works:
            left = max(0.001, deadline - time.monotonic())  # 0 would mean the group's default
            work.wait(datetime.timedelta(seconds=left))
        return True


class Retired:
    """Groups that are no longer used and only wait to be torn down, off the sync's path."""

    def __init__(self) -> None:
        self.groups: list[Group] = []

    def add(self, group: Group) -> None:
        self.groups.append(group)

    def release(self) -> None:
        # abort: a retired group's peers may be gone (that is often why it was retired)
        while self.groups:
            self.groups.pop().close(ok=False)


def _rank_of(key: str, world_size: int) -> tuple[int, ...]:
    """The member rank whose rendezvous entry `key` is (gloo's keys end in "/<rank>"); ()
    when the key is not one."""
    tail = key.rsplit("/", 1)[-1]
    return (int(tail),) if tail.isdigit() and 0 < int(tail) < world_size else ()


def make_pg(
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


class Buffers:
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
        torch_dtype = DTYPES[dtype]
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


class Pipeline:
    """Broadcasts in flight, oldest first: at most one waits while the next bucket is filled
    (sender) or loaded (receiver), so copying overlaps the transfer."""

    def __init__(self, group: Group, on_done: Callable[[torch.Tensor], None]) -> None:
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


def listen(host: str) -> tuple[int, int]:
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


def store_client(address: str, group_name: str, where: Where) -> tuple[dist.Store, str]:
    """An actor's connection to learner rank 0's store at `address` ("host:port"),
    namespaced by the group's name, and the backend rank 0 set there before the rendezvous."""
    with where.phase("connecting to the weight store"):
        host, port = address.rsplit(":", 1)
        client = dist.TCPStore(
            host, int(port), is_master=False, timeout=where.timeout, wait_for_workers=False
        )
        store = dist.PrefixStore(group_name, client)
        backend = store.get("backend").decode()
    return store, backend
