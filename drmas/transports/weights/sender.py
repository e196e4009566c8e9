"""Learner rank 0 publishes: it hosts the run's weight store and broadcasts each new
version to the actors of the broker's WeightGroupPlan (ranks 1..n of the weight group).

Rank 0 streams: it pulls one gathered tensor at a time, copies it into the open bucket of
its dtype and starts broadcasting a bucket as soon as its last member is in, filling the
next one while it travels. Memory beyond the model: at most two reusable bucket buffers
per dtype; a tensor larger than a bucket travels alone, without a copy.

The group of a publish is kept for the next one while its name stays the same (the broker
names a group after its membership); a new name retires the old group, and a failed
publish aborts its group at once, so the next one forms a fresh group.

With the broker's token, a publish starts with a roll call through the store (membership.py):
only the members that check in with the token within weights.join_timeout_s receive it;
the others are left out (`PublishStats.left_out`, reported to the broker) and the group is
formed for the roster alone, once.
"""

from __future__ import annotations

import collections
import datetime
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from drmas.config.transport import WeightSyncConfig
from drmas.transports.digest import Digest, hashing
from drmas.transports.weights.group import (
    Buffers,
    Group,
    Pipeline,
    Retired,
    Where,
    advertised_host,
    listen,
    resolve_backend,
)
from drmas.transports.weights.layout import (
    DIGEST_BYTES,
    Bucket,
    Header,
    NamedTensors,
    TensorSpec,
    WeightSyncError,
    encode_header,
    plan_buckets,
    spec_of,
)
from drmas.transports.weights.membership import call_roll, roll_key, roster_group

log = logging.getLogger("drmas.weights")

RENDEZVOUS_MIN_S = 5.0
"""After a roll call, rank 0 waits at most max(this, weights.join_timeout_s) for the
members' rendezvous entries (not weights.timeout_s): each member checked in within
join_timeout_s and writes its entry as soon as it reads the roster (nothing heavier than
the check-in comes between), so one that has not written it by then never will. That
wait is what a member that checks in and never joins costs a publish (it used to cost
every publish 60 s, then one per model 10 s); rank 0 names it (PublishDone.broke)."""


@dataclass
class PublishStats:
    seconds: float
    bytes: int
    buckets: int
    reused: bool = False
    """Sent over the group of the previous publish (same members): no rendezvous."""
    left_out: list[int] = field(default_factory=list)
    """Planned ranks that did not check in with the token in time (roll call): not sent to."""


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
        port, fd = listen(self.host)
        self.store = dist.TCPStore(
            self.host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
            master_listen_fd=fd,  # torch owns (and closes) the socket from here
        )
        self._retired = Retired()
        self._buffers = Buffers(self.device)
        self._live: tuple[str, Group] | None = None  # (group name, group) kept for the next
        # the keys of the last two roll calls (the older go at the next one): a member still
        # reading the previous one's nonce never finds it gone
        self._rolls: collections.deque[tuple[dist.Store, list[str]]] = collections.deque()

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

    def _group(self, name: str, where: Where, token: str, present: list[int]) -> tuple[Group, bool]:
        """The group kept from the previous publish when `name` is its name; else a new one
        (the kept one is retired). `present`: the plan's rank of each of its ranks 1..n."""
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
        rendezvous_s = max(RENDEZVOUS_MIN_S, self.cfg.join_timeout_s)
        try:
            return Group(where, store, self.backend, self.device, token, rendezvous_s), False
        except WeightSyncError as exc:  # the rendezvous failed: name the plan's ranks
            exc.absent = tuple(present[r - 1] for r in exc.absent if r <= len(present))
            raise

    def publish(
        self,
        group_name: str,
        world_size: int,
        named_tensors: NamedTensors,
        timeout_s: float,
        *,
        specs: Sequence[TensorSpec] | None = None,
        peers: Sequence[str] = (),
        token: str = "",
        digest: Digest | None = None,
        version: int = 0,
    ) -> PublishStats:
        """Broadcast `named_tensors` to ranks 1..world_size-1 of group `group_name` (kept
        if it went through, aborted on WeightSyncError). `specs` (of each tensor, in order)
        lets the header go out before the first tensor is gathered. `token`: the roll call
        of `version`'s publish picks the members that prove they hold it in time (others:
        `left_out`; a failed rendezvous names who never came: WeightSyncError.absent), and
        each proves it again before the header. A digest of every byte sent follows the
        last bucket: `digest` if the caller hashes the stream, else one of its own."""
        self.release()
        start = time.monotonic()
        if specs is None:
            materialised = list(named_tensors)
            specs = [spec_of(n, t) for n, t in materialised]
            named_tensors = materialised
        header = Header(int(self.cfg.bucket_mb * 2**20), list(specs), self.cfg.verify_digest)
        buckets = plan_buckets(header.tensors, header.bucket_bytes)
        name, world_size, who, left_out, present = self._roster(
            group_name, world_size, peers, token, version
        )
        if world_size == 1:  # nobody checked in
            return PublishStats(time.monotonic() - start, 0, 0, False, left_out)
        group, reused = self._group(
            name, Where(name, 0, world_size, timeout_s, who), token, present
        )
        own = Digest() if header.digest and digest is None else None
        named_tensors = hashing(iter(named_tensors), own) if own else named_tensors
        try:
            if token:
                group.authenticate(token)
            length, payload = encode_header(header, self.device)
            group.broadcast(length, "header length")
            group.broadcast(payload, "header")
            sent = self._stream(group, header, buckets, named_tensors, digest or own)
        except BaseException:
            if own is not None:
                own.wait()  # a failed send leaves no hashing thread behind
            group.close(ok=False)
            self._live = None
            self._buffers.reset()
            raise
        self._live = (name, group)
        stats = PublishStats(time.monotonic() - start, sent, len(buckets), reused, left_out)
        log.info(
            "published %s: %.1f MB in %d buckets to %s in %.2fs (%s group)",
            group_name, sent / 1e6, stats.buckets, who, stats.seconds,
            "kept" if reused else "new",
        )  # fmt: skip
        return stats

    def _roster(
        self, group_name: str, world_size: int, peers: Sequence[str], token: str, version: int
    ) -> tuple[str, int, str, list[int], list[int]]:
        """(group name, world size, who, left-out ranks, present ranks: the plan's rank of
        each of the group's ranks 1..n) of the group this publish sends over: the planned
        one without a token; with one, the roll call's roster."""
        if not token:
            who = ", ".join(peers) if peers else f"ranks 1..{world_size - 1}"
            return group_name, world_size, who, [], list(range(1, world_size))
        present, left_out = self._roll_call(group_name, version, token, world_size - 1, peers)
        name = roster_group(group_name, version, len(present), world_size - 1)
        who = ", ".join(peers[r - 1] if peers else f"rank {r}" for r in present)
        return name, len(present) + 1, who, left_out, present

    def _roll_call(
        self, group_name: str, version: int, token: str, members: int, peers: Sequence[str]
    ) -> tuple[list[int], list[int]]:
        """(present ranks, left-out ranks) of this publish's roll call (membership.py); the keys
        of the roll call before the previous one are deleted (its members have read them, or
        see in the store that rank 0 moved on and fail at once)."""
        while len(self._rolls) >= 2:
            old_store, keys = self._rolls.popleft()
            for key in keys:
                old_store.delete_key(key)
        store = dist.PrefixStore(group_name, self.store)
        store.set("backend", self.backend)  # members read it before they check in
        roll = call_roll(store, group_name, version, token, members, self.cfg.join_timeout_s)
        keys = [roll_key(version, k) for k in ("nonce", "roster", *range(1, members + 1))]
        self._rolls.append((store, keys))

        def named(ranks: list[int]) -> str:
            return ", ".join(peers[r - 1] if peers else f"rank {r}" for r in ranks)

        if roll.absent:
            log.warning(
                "%s v%d: %s did not check in within weights.join_timeout_s=%gs: left out",
                group_name, version, named(roll.absent), self.cfg.join_timeout_s,
            )  # fmt: skip
        if roll.refused:
            log.warning(
                "%s v%d: %s checked in without the group's token (a store client, not a "
                "member of the broker's plan): left out",
                group_name, version, named(roll.refused),
            )  # fmt: skip
        return roll.present, sorted(roll.absent + roll.refused)

    def _stream(
        self,
        group: Group,
        header: Header,
        buckets: Sequence[Bucket],
        named_tensors: NamedTensors,
        fed: Digest | None = None,
    ) -> int:
        """Copy tensors into their buckets as they arrive; send each bucket once complete;
        then the digest trailer, drawn from `fed` (it hashed every tensor as they streamed)."""
        specs = header.tensors
        where = {i: (b, off) for b, bucket in enumerate(buckets) for i, off, _ in bucket.members}
        pipeline = Pipeline(group, lambda t: self._buffers.give(t, header.bucket_bytes))
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
        if header.digest:
            value = ""
            if fed is not None:
                try:
                    value = fed.hexdigest_of(spec.name for spec in specs)
                except KeyError as exc:
                    raise WeightSyncError(f"the stream's digest never saw tensor {exc}") from None
            trailer = value.encode().ljust(DIGEST_BYTES, b"0")[:DIGEST_BYTES]
            data = torch.frombuffer(bytearray(trailer), dtype=torch.uint8).to(self.device)
            group.broadcast(data, "digest")
        return sent
