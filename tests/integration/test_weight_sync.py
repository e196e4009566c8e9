"""Weight groups over gloo on loopback: learner rank 0 (this test process) -> receiver
processes. Checks bit-identical delivery of a mixed bf16/fp32 model, identical bucket
layouts on both sides, and bounded waits when a peer never comes.

A wait that never ends is what the bounded-wait tests guard against; they do not time
the waits. Each checks that the publish gives up with a WeightSyncTimeout or
WeightSyncError naming the configured limit, the group, the peer and the phase, after
the event that caused it; the pytest timeout marks stop a test that hangs instead."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import msgspec
import pytest
import torch

from drmas.config.transport import WeightSyncConfig
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.weights import (
    Header,
    TensorSpec,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    WeightSyncTimeout,
    plan_buckets,
    spec_of,
)

pytestmark = pytest.mark.slow


def tiny_state() -> list[tuple[str, torch.Tensor]]:
    """A real tiny Qwen2's parameters; matrices in bf16, biases and norms in fp32, so the
    two dtypes interleave in name order."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=67,  # odd sizes everywhere
        hidden_size=48,
        intermediate_size=100,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    return [
        (name, p.detach().to(torch.bfloat16 if p.dim() == 2 else torch.float32).clone())
        for name, p in model.named_parameters()
    ]


def join(sender: WeightSender, group: str, rank: int, world: int, timeout_s: float = 30.0):
    return JoinWeightGroup("m", 1, group, sender.store_address, rank, world, timeout_s)


def receive_worker(joins: list[JoinWeightGroup], out: str) -> None:
    """A receiver process: joins each group in turn, records tensors and bucket layout."""
    torch.set_num_threads(1)
    receiver = WeightReceiver(WeightSyncConfig())
    results = []
    for j in joins:
        state: dict[str, torch.Tensor] = {}
        buckets: list[list[str]] = []

        def load(batch, state=state, buckets=buckets) -> None:
            batch = list(batch)
            buckets.append([name for name, _ in batch])
            state.update((name, t.clone()) for name, t in batch)

        kept = receiver.kept(j.model) == j.group_name  # no rendezvous: the group it holds
        stats = receiver.receive_into(j, load)
        results.append({"state": state, "buckets": buckets, "bytes": stats.bytes, "kept": kept})
    receiver.close()
    torch.save(results, out)


def spawn_receiver(joins: list[JoinWeightGroup], out: Path) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(
        target=receive_worker, args=(joins, str(out)), daemon=True
    )
    proc.start()
    return proc


def test_bucket_plan_is_shared_and_sound() -> None:
    shapes = [(7, 3), (5,), (11, 13), (1,), (300,), (2, 2, 3), (17,), (9, 9)]
    dtypes = [
        "bfloat16",
        "float32",
        "bfloat16",
        "float32",
        "float32",
        "bfloat16",
        "float16",
        "float32",
    ]
    specs = [TensorSpec(f"t{i}", s, d) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    bucket_bytes = 333  # odd, smaller than the largest tensor (1200 bytes)

    # The receiver plans from the decoded header: same layout as the sender's.
    header = msgspec.msgpack.decode(
        msgspec.msgpack.encode(Header(bucket_bytes, specs)), type=Header
    )
    plan = plan_buckets(specs, bucket_bytes)
    assert plan_buckets(header.tensors, header.bucket_bytes) == plan

    seen = [i for bucket in plan for i, _, _ in bucket.members]
    assert sorted(seen) == list(range(len(specs)))  # every tensor exactly once
    assert [b.last for b in plan] == sorted(b.last for b in plan)  # sendable while streaming
    for bucket in plan:
        assert {specs[i].dtype for i, _, _ in bucket.members} == {bucket.dtype}
        offsets = [off for _, off, _ in bucket.members]
        assert offsets == [sum(n for _, _, n in bucket.members[:k]) for k in range(len(offsets))]
        size = sum(specs[i].nbytes for i, _, _ in bucket.members)
        assert size <= bucket_bytes or len(bucket.members) == 1
    # Hand-derived: fp32 tensors t1 (20 B) + t3 (4 B) share a bucket, t4 (1200 B) is alone.
    assert any([i for i, _, _ in b.members] == [1, 3] for b in plan)
    assert any([i for i, _, _ in b.members] == [4] for b in plan)


def test_two_receivers_get_bit_identical_weights(tmp_path: Path) -> None:
    state = tiny_state()
    assert {t.dtype for _, t in state} == {torch.bfloat16, torch.float32}
    big = WeightSender(WeightSyncConfig(bucket_mb=8.0))
    small = WeightSender(WeightSyncConfig(bucket_mb=3001 / 2**20))  # many odd-sized buckets
    groups = [(big, "m-v1"), (small, "m-v2")]
    procs = [
        spawn_receiver([join(s, g, rank, 3) for s, g in groups], tmp_path / f"r{rank}.pt")
        for rank in (1, 2)
    ]
    try:
        specs = [spec_of(n, t) for n, t in state]
        # Streaming publish: header from specs, tensors pulled one at a time.
        first = big.publish("m-v1", 3, iter(state), 30.0, specs=specs)
        second = small.publish("m-v2", 3, state, 30.0)  # materialised, no specs
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()

    total = sum(t.numel() * t.element_size() for _, t in state)
    assert first.bytes == second.bytes == total
    assert first.buckets == 2  # one per dtype
    layouts = {
        "m-v1": plan_buckets(specs, int(8.0 * 2**20)),
        "m-v2": plan_buckets(specs, 3001),
    }
    assert second.buckets == len(layouts["m-v2"]) > 10
    for rank in (1, 2):
        results = torch.load(tmp_path / f"r{rank}.pt", weights_only=False)
        for (_, group), got in zip(groups, results):
            assert sorted(got["state"]) == sorted(n for n, _ in state)
            for name, tensor in state:
                received = got["state"][name]
                assert received.dtype == tensor.dtype and torch.equal(received, tensor), name
            expected = [[specs[i].name for i, _, _ in b.members] for b in layouts[group]]
            assert got["buckets"] == expected
            assert got["bytes"] == total


def test_a_group_persists_while_its_members_do(tmp_path: Path) -> None:
    """Three versions to the same two receivers go over one group (one rendezvous); a new
    membership (one receiver left) forms a new group under a new name."""
    base = tiny_state()
    specs = [spec_of(n, t) for n, t in base]
    sender = WeightSender(WeightSyncConfig(bucket_mb=3001 / 2**20))
    kept = [join(sender, "m/g1", rank, 3) for rank in (1, 2)]
    procs = [
        spawn_receiver([kept[0]] * 3 + [join(sender, "m/g2", 1, 2)], tmp_path / "r1.pt"),
        spawn_receiver([kept[1]] * 3, tmp_path / "r2.pt"),
    ]

    def version(v: int) -> list[tuple[str, torch.Tensor]]:
        return [(n, t + v) for n, t in base]

    try:
        stats = [sender.publish("m/g1", 3, iter(version(v)), 30.0, specs=specs) for v in (1, 2, 3)]
        stats.append(sender.publish("m/g2", 2, iter(version(4)), 30.0, specs=specs))
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0
    finally:
        sender.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    assert [s.reused for s in stats] == [False, True, True, False]
    r1 = torch.load(tmp_path / "r1.pt", weights_only=False)
    r2 = torch.load(tmp_path / "r2.pt", weights_only=False)
    assert [r["kept"] for r in r1] == [False, True, True, False]
    assert [r["kept"] for r in r2] == [False, True, True]
    for results in (r1, r2):
        for v, got in enumerate(results, start=1):
            assert all(torch.equal(got["state"][n], t) for n, t in version(v)), v


@pytest.mark.timeout(300)
def test_missing_receiver_times_out_and_sender_recovers(tmp_path: Path) -> None:
    sender = WeightSender(WeightSyncConfig())
    state = [("w", torch.arange(10, dtype=torch.float32)), ("b", torch.ones(3))]

    with pytest.raises(WeightSyncTimeout) as err:
        sender.publish("m-v7", 2, state, 3.0, peers=["actor-a"])
    text = str(err.value)
    assert "'m-v7'" in text and "rendezvous" in text and "actor-a" in text
    assert "(timeout 3s)" in text  # it gave up on the publish's own limit

    # A receiver sent to a group that is never published gives up just as cleanly.
    with pytest.raises(WeightSyncTimeout) as err:
        WeightReceiver().receive_into(join(sender, "m-v8", 1, 2, timeout_s=2.0), lambda _: None)
    assert "'m-v8'" in str(err.value) and "learner rank 0" in str(err.value)
    assert "(timeout 2s)" in str(err.value)

    # The next version forms a fresh group on the same store and goes through.
    proc = spawn_receiver([join(sender, "m-v9", 1, 2)], tmp_path / "late.pt")
    try:
        stats = sender.publish("m-v9", 2, state, 30.0)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert stats.bytes == 13 * 4
    got = torch.load(tmp_path / "late.pt", weights_only=False)[0]["state"]
    assert all(torch.equal(got[n], t) for n, t in state)


def slow_receive_worker(j: JoinWeightGroup, started: str) -> None:
    """A receiver that says it is ready (torch imported, about to join), announces its
    first bucket, then dawdles so it can be killed mid-way."""
    torch.set_num_threads(1)

    def load(batch) -> None:
        list(batch)
        Path(started).touch()
        time.sleep(0.5)

    receiver = WeightReceiver(WeightSyncConfig())
    Path(started + ".ready").touch()
    receiver.receive_into(j, load)


def wait_ready(started: Path, proc: multiprocessing.Process) -> None:
    """The ready handshake: a freshly spawned interpreter takes seconds to import torch on
    a loaded machine, which must not count against the publish's own (short) limits."""
    deadline = time.monotonic() + 120
    while not started.with_suffix(".ready").exists():
        assert proc.is_alive() and time.monotonic() < deadline, "receiver never got ready"
        time.sleep(0.02)


@pytest.mark.timeout(300)
def test_receiver_killed_during_broadcast_fails_the_publish_in_bounded_time(
    tmp_path: Path,
) -> None:
    import os
    import signal

    # 12 x 4 MiB, one tensor per bucket: far more than socket buffers hold, so the sender is
    # still sending when the receiver dies
    state = [(f"p{i}", torch.full((2**20,), float(i))) for i in range(12)]
    sender = WeightSender(WeightSyncConfig(bucket_mb=4.0))
    started = tmp_path / "started"
    proc = multiprocessing.get_context("spawn").Process(
        target=slow_receive_worker, args=(join(sender, "m-v1", 1, 2), str(started)), daemon=True
    )
    proc.start()
    wait_ready(started, proc)
    killer_done = []

    def kill_when_receiving() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # mid-broadcast: buckets still to come
        killer_done.append(True)

    import threading

    killer = threading.Thread(target=kill_when_receiving, daemon=True)
    killer.start()
    try:
        with pytest.raises(WeightSyncError) as err:
            sender.publish("m-v1", 2, state, 5.0, peers=["actor-a"])
    finally:
        killer.join(70)
        proc.join(10)
    assert killer_done, "the receiver never started receiving"
    assert "'m-v1'" in str(err.value) and "actor-a" in str(err.value)  # group and peer named
    assert "bucket" in str(err.value)  # and the phase: it died between buckets

    # The run goes on: the next version re-forms the group without the dead actor.
    proc = spawn_receiver([join(sender, "m-v2", 1, 2)], tmp_path / "next.pt")
    try:
        stats = sender.publish("m-v2", 2, state, 30.0)
        proc.join(60)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
    assert stats.bytes == 12 * 2**20 * 4
    got = torch.load(tmp_path / "next.pt", weights_only=False)[0]["state"]
    assert all(torch.equal(got[n], t) for n, t in state)


@pytest.mark.timeout(300)
def test_receiver_that_stops_answering_mid_broadcast_times_out_the_sender(
    tmp_path: Path,
) -> None:
    """A peer alive but frozen (SIGSTOP) inside the broadcast: the sender must give up
    within the configured limit with an error naming the group, the peer and the phase."""
    import os
    import signal
    import threading

    state = [(f"p{i}", torch.full((2**20,), float(i))) for i in range(12)]  # 12 x 4 MiB
    sender = WeightSender(WeightSyncConfig(bucket_mb=4.0))
    started = tmp_path / "started"
    proc = multiprocessing.get_context("spawn").Process(
        target=slow_receive_worker, args=(join(sender, "m-v1", 1, 2), str(started)), daemon=True
    )
    proc.start()
    wait_ready(started, proc)

    def freeze_when_receiving() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGSTOP)
        frozen.set()

    frozen = threading.Event()
    freezer = threading.Thread(target=freeze_when_receiving, daemon=True)
    freezer.start()
    limit = 4.0
    frozen_when_it_gave_up = False
    try:
        with pytest.raises(WeightSyncTimeout) as err:
            try:
                sender.publish("m-v1", 2, state, limit, peers=["actor-frozen"])
            finally:  # the publish can only time out `limit` after the receiver froze
                frozen_when_it_gave_up = frozen.is_set()
    finally:
        freezer.join(70)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    assert started.exists(), "the receiver never started receiving"
    assert frozen_when_it_gave_up, "the publish gave up before the receiver stopped answering"
    text = str(err.value)
    assert "'m-v1'" in text and "actor-frozen" in text and "bucket" in text and "timeout 4s" in text
