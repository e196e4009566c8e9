"""Actors load: an actor joins the weight group a JoinWeightGroup from the broker names
(learner rank 0's store address, group name, its rank) and receives one version, bucket by
bucket, into the engine's model.

It receives the next bucket while `load` copies the current one, keeping at most two
reusable bucket buffers per dtype. The group is kept for the model's next version while
the broker names the same group, store and rank; otherwise the old one is retired.

What arrives proves itself before the engine may serve it:
- the join's token: this actor checks in at rank 0's roll call with it and takes its rank
  from the roster rank 0 signed with it (a member that was late is left out and loads
  nothing: WeightSyncError), then answers rank 0's challenge, sent over the group,
  through the store (membership.py);
- the header: at most MAX_HEADER_BYTES, and, when the engine says what it holds
  (`Expected`), exactly its parameter set (or the adapters the publish carries) by name,
  shape and dtype, checked before the first bucket; buffers never exceed what the header's
  tensors add up to, whatever bucket size rank 0 announces;
- the bytes: with a digest trailer, a digest of everything received is compared with it
  after the last bucket; a mismatch raises WeightSyncError, and the actor rolls the engine
  back or quarantines it exactly as on a failed load (the engine is paused throughout).
  Given the engine's own tensors (`live`), the receiver hashes those once each bucket is
  loaded instead of the bucket: one hash then proves the bytes arrived intact and that the
  engine holds them, and is the fingerprint the actor reports (no second pass over the
  model); hashing runs on worker threads while the next bucket arrives and loads;
- the values: a bucket holding NaN or inf raises WeightSyncError before it is handed on
  (drmas/finite.py), whatever the digest says.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from drmas.config.transport import WeightSyncConfig
from drmas.finite import describe, non_finite_names
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.digest import Digest
from drmas.transports.weights.group import (
    Buffers,
    Group,
    Pipeline,
    Retired,
    Where,
    resolve_backend,
    store_client,
)
from drmas.transports.weights.layout import (
    DIGEST_BYTES,
    MAX_HEADER_BYTES,
    Bucket,
    Expected,
    Header,
    NamedTensors,
    WeightSyncError,
    check_covers,
    decode_header,
    header_bytes,
    plan_buckets,
)
from drmas.transports.weights.membership import answer_roll, roster_group

Expecting = Callable[[JoinWeightGroup], "Expected | None"]
"""What the engine serving a join's model holds (None: not known, not checked)."""
Live = Callable[[list[str]], NamedTensors]
"""The tensors the engine serves under these names, as `load` left them (same dtype as
sent: their bytes are the received ones when the load went right)."""


@dataclass
class ReceiveStats:
    seconds: float
    bytes: int
    buckets: int
    tensors: int
    digest: str = ""
    """With `live` and a header checked against what the engine holds: the fingerprint of
    the engine's tensors (drmas.transports.digest), equal to the sender's; else ""."""


class WeightReceiver:
    """Actor side: joins the group a JoinWeightGroup names and receives one version."""

    def __init__(
        self,
        cfg: WeightSyncConfig | None = None,
        device: torch.device | str = "cpu",
        expected: Expecting | None = None,
    ) -> None:
        self.cfg = cfg or WeightSyncConfig()
        self.expected = expected
        self.device = torch.device(device)
        self.backend = resolve_backend(self.cfg, self.device)
        self._retired = Retired()
        self._buffers = Buffers(self.device)
        # model -> ((group name, store address, rank, world size), group) kept for the next
        self._live: dict[str, tuple[tuple[str, str, int, int], Group]] = {}
        # of the last receive without `live`: whether it checks rank 0's digest (known
        # before its first tensor), and the digest it checked (once it ended without error)
        self.verifying = False
        self.arrived_digest = ""

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

    def _group(
        self, join: JoinWeightGroup, where: Where
    ) -> tuple[Group, tuple[str, str, int, int]]:
        """This publish's group and its key: with a token, after the roll call (the rank and
        size of the roster's group); the group kept from the previous version of this model
        when the key is the same; else a new one (the kept one is retired)."""
        key = (join.group_name, join.store_address, join.rank, join.world_size)
        store: Any = None
        if join.token:  # check in; the roster says the rank and size of the group formed
            store = self._store(join, where)
            with where.phase("roll call"):
                rank, size = answer_roll(
                    store, join.group_name, join.version, join.token, join.rank, where.timeout_s
                )
            name = roster_group(join.group_name, join.version, size - 1, join.world_size - 1)
            key = (name, join.store_address, rank, size)
            where.group, where.rank, where.world_size = name, rank, size
            if name != join.group_name:
                store = dist.PrefixStore(name.removeprefix(f"{join.group_name}/"), store)
        live = self._live.pop(join.model, None)
        if live is not None and live[0] == key:
            live[1].where = where
            return live[1], key
        if live is not None:
            self._retired.add(live[1])
            self._retired.release()
        store = store or self._store(join, where)
        return Group(where, store, self.backend, self.device, join.token), key

    def _store(self, join: JoinWeightGroup, where: Where) -> Any:
        """A connection to rank 0's store, namespaced by the group's name, whose backend
        must be this receiver's."""
        store, backend = store_client(join.store_address, join.group_name, where)
        if backend != self.backend:
            raise WeightSyncError(
                f"weight group {join.group_name!r}: learner broadcasts over {backend}, this "
                f"actor resolved {self.backend} (device {self.device}); set weights.backend"
            )
        return store

    def receive_into(
        self,
        join: JoinWeightGroup,
        load: Callable[[NamedTensors], None],
        expected: Expected | None = None,
        live: Live | None = None,
    ) -> ReceiveStats:
        """Receive every bucket and call `load` once per bucket with (HF name, tensor) views
        into it. The views are only valid during that call (the buffer is reused for a later
        bucket): `load` copies them into the model, as Engine.load_weights does. Raises
        WeightSyncError before the first `load` on a header that is not `expected` (else
        what the receiver's `expected` says), and after the last on a digest mismatch.
        `live`: the engine's tensors by name after a `load`: hashed instead of the bucket
        (their fingerprint comes back in ReceiveStats.digest)."""
        start = time.monotonic()
        nbytes = buckets = tensors = 0
        stream = self._buckets(join, expected, live)
        while True:
            try:
                batch = next(stream)
            except StopIteration as end:
                fingerprint = end.value
                break
            load(batch)
            buckets += 1
            tensors += len(batch)
            nbytes += sum(t.numel() * t.element_size() for _, t in batch)
        return ReceiveStats(time.monotonic() - start, nbytes, buckets, tensors, fingerprint)

    def receive(
        self, join: JoinWeightGroup, expected: Expected | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Same as receive_into, as a flat generator; consume it fully (or close it). A tensor
        is valid until the generator moves past the end of its bucket. The digest is checked
        when the last tensor has been taken: a consumer loading in place must treat what it
        loaded as bad until the generator ends without an error."""
        for batch in self._buckets(join, expected):
            yield from batch

    def _buckets(
        self, join: JoinWeightGroup, expected: Expected | None, live: Live | None = None
    ) -> Generator[list[tuple[str, torch.Tensor]], None, str]:
        """Each bucket's (name, view) pairs, checked; returns the fingerprint of `live`'s
        tensors when they were hashed and the header covers what the engine holds, else ""."""
        self.release()
        peer = f"learner rank 0 of {join.model} at {join.store_address}"
        where = Where(join.group_name, join.rank, join.world_size, join.timeout_s, peer)
        if expected is None and self.expected is not None:
            expected = self.expected(join)
        group, key = self._group(join, where)
        digest: Digest | None = None
        try:
            if join.token:
                group.authenticate(join.token)
            header = self._header(group)
            if expected is not None:
                check_covers(header, expected, join.group_name)
            # never more than the tensors add up to, whatever bucket size was announced
            cap = max(1, min(header.bucket_bytes, header_bytes(header)))
            plan = plan_buckets(header.tensors, header.bucket_bytes)
            pipeline = Pipeline(group, lambda t: None)
            digest = Digest() if header.digest else None
            self.verifying, self.arrived_digest = digest is not None and live is None, ""
            if plan:
                self._post(pipeline, plan, 0, cap)
            for b, bucket in enumerate(plan):
                if b + 1 < len(plan):
                    self._post(pipeline, plan, b + 1, cap)  # arrives while b is loaded
                flat = pipeline.pop()
                batch = [
                    (header.tensors[i].name, flat[off : off + n].view(header.tensors[i].shape))
                    for i, off, n in bucket.members
                ]
                if digest is not None and live is None:
                    for name, tensor in batch:
                        digest.submit(name, tensor)
                _refuse_non_finite(batch, group)
                yield batch
                if digest is not None and live is not None:  # what the engine now holds
                    for name, tensor in live([name for name, _ in batch]):
                        digest.submit(name, tensor)
                elif digest is not None:
                    digest.wait(close=False)  # the buffer takes a later bucket from here
                self._buffers.give(flat, cap)
            if digest is not None:
                self._check_digest(group, digest, live is not None)
                if live is None:  # what arrived, equal to rank 0's digest of what it sent
                    self.arrived_digest = digest.hexdigest()
        except BaseException:  # includes GeneratorExit: the caller stopped early
            if digest is not None:
                digest.wait()  # no hash left reading a buffer or the engine
            group.close(ok=False)
            self._buffers.reset()
            raise
        self._live[join.model] = (key, group)
        covered = digest is not None and live is not None and expected is not None
        return digest.hexdigest() if covered and digest is not None else ""

    def _post(self, pipeline: Pipeline, plan: list[Bucket], b: int, cap: int) -> None:
        buffer = self._buffers.take(plan[b].dtype, plan[b].numel, cap)
        pipeline.push(buffer, f"bucket {b} of {len(plan)}")

    def _check_digest(self, group: Group, digest: Digest, loaded: bool = False) -> None:
        """Compare what arrived (`loaded`: what the engine holds after loading it) with rank
        0's digest of what it sent, before the caller may make it live."""
        trailer = torch.zeros(DIGEST_BYTES, dtype=torch.uint8, device=self.device)
        group.broadcast(trailer, "digest")
        sent = trailer.cpu().numpy().tobytes()
        got = digest.hexdigest().encode().ljust(DIGEST_BYTES, b"0")[:DIGEST_BYTES]
        if sent != got:
            raise WeightSyncError(
                f"weight group {group.where.group!r}: digest of the received weights "
                f"{got.decode(errors='replace')} differs from rank 0's "
                f"{sent.decode(errors='replace')[:DIGEST_BYTES]}: bytes changed on the way"
                f"{' or the engine did not take them as sent' if loaded else ''}; "
                "not making them live"
            )

    def _header(self, group: Group) -> Header:
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


def _refuse_non_finite(batch: list[tuple[str, torch.Tensor]], group: Group) -> None:
    """No bucket with NaN or inf reaches an engine (hf, SGLang, vLLM's workers all load
    through here): a correct digest only proves the bytes are the sender's."""
    bad = non_finite_names(batch)
    if bad:
        raise WeightSyncError(
            f"weight group {group.where.group!r}: NaN or inf in {describe(bad)} from learner "
            "rank 0; not making them live (the learner refuses to publish such weights: is "
            "it a drmas learner of this version?)"
        )
