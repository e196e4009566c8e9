"""Weights that prove themselves: what a receiver refuses before loading a byte (a header
that does not cover the engine's parameters, a peer without the group's token) and what
it refuses before the weights go live (bytes that differ from rank 0's digest), and how
much it allocates whatever bucket size is announced.

Both ends run in this process over gloo on loopback: the sender (or a rogue rank 0 built
from the same pieces, to send what an honest sender never would) in a thread, the
receiver in the test's thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from drmas.config.transport import WeightSyncConfig
from drmas.protocol.messages import JoinWeightGroup
from drmas.transports.weights import (
    MAX_BUCKET_BYTES,
    Header,
    TensorSpec,
    WeightReceiver,
    WeightSender,
    WeightSyncError,
    spec_of,
)
from drmas.transports.weights.group import Group, Where
from drmas.transports.weights.layout import encode_header, expected_of

CPU = torch.device("cpu")


def model() -> list[tuple[str, torch.Tensor]]:
    """Four tensors of two dtypes, values known by hand (i-th tensor filled with i + 1)."""
    return [
        ("a.weight", torch.full((4, 4), 1.0)),
        ("a.bias", torch.full((4,), 2.0)),
        ("b.weight", torch.full((3, 4), 3.0, dtype=torch.bfloat16)),
        ("b.bias", torch.full((3,), 4.0)),
    ]


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except Exception as exc:  # the test inspects it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def join(sender: WeightSender, name: str, token: str = "", timeout_s: float = 10.0):
    return JoinWeightGroup("m", 1, name, sender.store_address, 1, 2, timeout_s, token)


def receive(receiver: WeightReceiver, j: JoinWeightGroup, expected=None):
    """(tensors loaded, in order of arrival, as copies; the error raised or None)."""
    loaded: list[tuple[str, torch.Tensor]] = []

    def load(batch) -> None:
        loaded.extend((name, t.clone()) for name, t in batch)

    try:
        receiver.receive_into(j, load, expected)
    except WeightSyncError as exc:
        return loaded, exc
    return loaded, None


def rogue_rank0(
    sender: WeightSender,
    name: str,
    header: Header,
    buckets: list[torch.Tensor],
    token: str = "",
) -> None:
    """What a rank 0 could send that WeightSender never does: any header, any buckets."""
    store = dist.PrefixStore(name, sender.store)
    store.set("backend", "gloo")
    group = Group(Where(name, 0, 2, 5.0, "rank 1"), store, "gloo", CPU)
    try:
        if token:
            group.authenticate(token)
        length, payload = encode_header(header, CPU)
        group.broadcast(length, "header length")
        group.broadcast(payload, "header")
        for i, bucket in enumerate(buckets):
            group.broadcast(bucket, f"bucket {i}")
    finally:
        group.close(ok=False)


@pytest.fixture
def sender():
    s = WeightSender(WeightSyncConfig(host="127.0.0.1", timeout_s=10.0))
    yield s
    s.close()


def test_an_honest_publish_with_token_digest_and_expectation_arrives_whole(sender) -> None:
    state = model()
    receiver = WeightReceiver()
    thread, out = in_thread(lambda: sender.publish("g1", 2, state, 10.0, token="t0k", version=1))
    loaded, error = receive(receiver, join(sender, "g1", "t0k"), expected_of(state, "m"))
    thread.join(30)
    receiver.close()
    assert error is None and "error" not in out
    # bf16 bucket first: its last member (index 2) comes before the fp32 bucket's (3)
    assert [n for n, _ in loaded] == ["b.weight", "a.weight", "a.bias", "b.bias"]
    got = dict(loaded)
    for name, tensor in state:
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor)


def test_a_header_naming_one_of_four_tensors_filled_with_nan_is_refused_unloaded(
    sender,
) -> None:
    """The attack: rank 0 announces only a.weight, full of NaN. Without an expectation it
    would be loaded and the rest of the model left as it was; with one it is refused
    before any bucket arrives."""
    header = Header(2**20, [TensorSpec("a.weight", (4, 4), "float32")])
    nan = torch.full((16,), float("nan"))
    thread, _ = in_thread(lambda: rogue_rank0(sender, "g2", header, [nan]))
    receiver = WeightReceiver()
    loaded, error = receive(receiver, join(sender, "g2"), expected_of(model(), "every param"))
    thread.join(30)
    receiver.close()
    assert loaded == []  # not one byte reached the engine
    assert isinstance(error, WeightSyncError)
    assert "missing 3" in str(error) and "'a.bias'" in str(error)


@pytest.mark.parametrize(
    "specs, match",
    [
        ([("a.weight", (4, 4), "float32"), ("a.bias", (4,), "float32")], "missing 2"),
        (
            [(n, tuple(t.shape), spec_of(n, t).dtype) for n, t in model()]
            + [("c.weight", (2,), "float32")],
            "unknown 1",
        ),
        (
            [(n, tuple(t.shape), spec_of(n, t).dtype) for n, t in model()]
            + [("a.bias", (4,), "float32")],
            "repeated 1",
        ),
        (
            [("a.weight", (16,), "float32")]
            + [(n, tuple(t.shape), spec_of(n, t).dtype) for n, t in model()[1:]],
            "engine holds float32 \\(4, 4\\)",
        ),
        (
            [("a.weight", (4, 4), "int64")]
            + [(n, tuple(t.shape), spec_of(n, t).dtype) for n, t in model()[1:]],
            "announced as int64",
        ),
    ],
)
def test_the_coverage_check_refuses_partial_extra_repeated_and_misshapen_headers(
    specs, match
) -> None:
    from drmas.transports.weights.layout import check_covers

    header = Header(2**20, [TensorSpec(*s) for s in specs])
    with pytest.raises(WeightSyncError, match=match):
        check_covers(header, expected_of(model(), "every parameter"), "g")
    # a float tensor may arrive in another float dtype (the engine casts on copy)
    cast = Header(2**20, [TensorSpec(n, tuple(t.shape), "bfloat16") for n, t in model()])
    check_covers(cast, expected_of(model(), "every parameter"), "g")


def test_tampered_bytes_are_refused_before_going_live(sender, monkeypatch) -> None:
    """Bytes changed after rank 0 fingerprinted them: every bucket arrives, then the digest
    trailer disagrees and the receive raises, so the caller rolls back or quarantines."""
    import drmas.transports.weights.sender as sender_module
    from drmas.transports.weights.group import Pipeline

    class Tampering(Pipeline):
        def push(self, tensor: torch.Tensor, what: str) -> None:
            tensor = tensor.clone()
            tensor.view(torch.uint8)[0] ^= 1  # one bit of each bucket on the way
            super().push(tensor, what)

    monkeypatch.setattr(sender_module, "Pipeline", Tampering)
    thread, out = in_thread(lambda: sender.publish("g3", 2, model(), 10.0))
    receiver = WeightReceiver()
    loaded, error = receive(receiver, join(sender, "g3"), expected_of(model(), "m"))
    thread.join(30)
    receiver.close()
    assert "error" not in out  # rank 0 sent everything as usual
    assert len(loaded) == 4  # it all arrived (the engine is still paused) ...
    assert isinstance(error, WeightSyncError) and "digest" in str(error)  # ... and is refused
    assert "not making them live" in str(error)


def test_a_non_member_without_the_token_gets_no_weights(sender) -> None:
    """A peer that reached the store checks in as rank 1 with a guessed token: rank 0's roll
    call finds its proof wrong and leaves it out, so no group forms and nothing is sent;
    the peer cannot forge the roster either (it is signed with the token)."""
    state = model()
    publish = lambda: sender.publish("g4", 2, state, 10.0, token="secret", version=1)  # noqa: E731
    thread, out = in_thread(publish)
    intruder = WeightReceiver()
    loaded, error = receive(intruder, join(sender, "g4", "guessed", timeout_s=5.0))
    thread.join(30)
    intruder.close()
    assert loaded == [] and "not signed with the group's token" in str(error)
    assert "error" not in out  # not a failed publish: one with nobody to send to
    assert out["result"].left_out == [1] and out["result"].bytes == 0


def test_the_roll_call_sends_to_members_that_check_in_and_leaves_the_rest_out() -> None:
    """Ranks 1..3 planned: rank 1 answers with a guessed token, rank 2 never comes, rank 3
    is honest. After weights.join_timeout_s rank 0 sends to rank 3 alone, which takes rank
    1 of a two-rank group; the publish waits the join timeout, not the group's (10 s)."""
    s = WeightSender(WeightSyncConfig(host="127.0.0.1", timeout_s=10.0, join_timeout_s=1.0))
    state = model()
    try:
        publish = lambda: s.publish("g6", 4, state, 10.0, token="tok", version=3)  # noqa: E731
        thread, out = in_thread(publish)
        guessed = JoinWeightGroup("m", 3, "g6", s.store_address, 1, 4, 10.0, "guess")
        honest = JoinWeightGroup("m", 3, "g6", s.store_address, 3, 4, 10.0, "tok")
        intruder, member = WeightReceiver(), WeightReceiver()
        t2, bad = in_thread(lambda: receive(intruder, guessed))
        loaded, error = receive(member, honest, expected_of(state, "m"))
        thread.join(30)
        t2.join(30)
        intruder.close()
        member.close()
    finally:
        s.close()
    assert error is None and dict(loaded).keys() == dict(state).keys()
    stats = out["result"]
    assert stats.left_out == [1, 2] and stats.bytes > 0
    assert stats.seconds < 10.0  # the join timeout, not the group's
    assert bad["result"][0] == [] and "not signed" in str(bad["result"][1])


def test_the_store_lists_keys_but_the_token_is_never_in_it(sender) -> None:
    """What a peer that reaches the store can read: group keys, never the token."""
    thread, out = in_thread(
        lambda: sender.publish("g5", 2, model(), 10.0, token="s3cr3t", version=1)
    )
    receiver = WeightReceiver()
    _, error = receive(receiver, join(sender, "g5", "s3cr3t"))
    thread.join(30)
    assert error is None and "error" not in out
    client = dist.TCPStore("127.0.0.1", sender.store.port, is_master=False, wait_for_workers=False)
    keys = client.list_keys() if hasattr(client, "list_keys") else []
    for key in keys:
        assert b"s3cr3t" not in client.get(key)
    receiver.close()


def test_an_oversized_bucket_announce_allocates_no_more_than_the_model(sender) -> None:
    """rank 0 announces the largest bucket allowed (8 GiB) for a 256-byte model: the
    receiver's buffers hold at most the 256 bytes the header's tensors add up to."""
    specs = [TensorSpec(f"w{i}", (4, 4), "float32") for i in range(4)]
    header = Header(MAX_BUCKET_BYTES, specs)
    flat = torch.arange(64, dtype=torch.float32)  # one bucket: all four, in order
    thread, _ = in_thread(lambda: rogue_rank0(sender, "g6", header, [flat]))
    receiver = WeightReceiver()
    allocated: list[int] = []
    take = receiver._buffers.take

    def spy(dtype: str, numel: int, bucket_bytes: int) -> torch.Tensor:
        buffer = take(dtype, numel, bucket_bytes)
        allocated.append(buffer.untyped_storage().nbytes())
        return buffer

    receiver._buffers.take = spy  # type: ignore[method-assign]
    loaded, error = receive(receiver, join(sender, "g6"))
    thread.join(30)
    receiver.close()
    assert error is None and len(loaded) == 4
    assert allocated == [4 * 16 * 4]  # 256 bytes, not 8 GiB
    assert torch.equal(dict(loaded)["w3"].reshape(-1), torch.arange(48, 64, dtype=torch.float32))
    with pytest.raises(WeightSyncError, match="at most"):
        from drmas.transports.weights import decode_header

        decode_header(
            encode_header(Header(MAX_BUCKET_BYTES + 1, specs), CPU)[1].numpy().tobytes(), "g"
        )


def test_a_digest_fed_by_the_stream_gives_the_same_trailer_without_hashing_again(
    sender,
) -> None:
    """The learner fingerprints every tensor it gathers (hashing); the sender draws the
    trailer from those fingerprints for the tensors it sent, here 2 of the 4 hashed (a
    LoRA publish carries some adapters; the learner hashed them all)."""
    from drmas.transports.digest import Digest, digest_of, hashing

    state = model()
    fed = Digest()
    stream = (item for item in hashing(iter(state), fed) if item[0].startswith("a."))
    specs = [spec_of(n, t) for n, t in state if n.startswith("a.")]
    publish = lambda: sender.publish("g7", 2, stream, 10.0, specs=specs, digest=fed)  # noqa: E731
    thread, out = in_thread(publish)
    loaded, error = receive(WeightReceiver(), join(sender, "g7"))
    thread.join(30)
    assert error is None and "error" not in out  # the trailer matched what arrived
    assert fed.hexdigest_of(["a.weight", "a.bias"]) == digest_of(state[:2])
    assert [n for n, _ in loaded] == ["a.weight", "a.bias"]


def test_a_rendezvous_entry_a_store_client_wrote_is_never_used(sender) -> None:
    """Before the member checks in, a store client writes rank 1's rendezvous entry (its own
    gloo address) under the group's prefix: rank 0 ignores it (not signed with the token)
    and connects to the member's own entry, which replaces it."""
    client = dist.TCPStore("127.0.0.1", sender.store.port, is_master=False, wait_for_workers=False)
    client.set("g8/0/1", b"\x00" * 40)  # what gloo's rendezvous of group g8 reads for rank 1
    state = model()
    thread, out = in_thread(lambda: sender.publish("g8", 2, state, 10.0, token="tok", version=1))
    receiver = WeightReceiver()
    loaded, error = receive(receiver, join(sender, "g8", "tok"), expected_of(state, "m"))
    thread.join(30)
    receiver.close()
    assert error is None and "error" not in out and len(loaded) == 4


def test_a_peer_in_the_group_without_the_token_cannot_kill_rank_0() -> None:
    """Two ranks formed straight from the store (as a peer that raced a member into the
    rendezvous would be): rank 1 answers the token challenge with a 1 MB all-gather, not
    a proof. Gloo aborts a process that receives more than it posted, but rank 0 receives
    nothing over the group: it waits for the proof in the store, finds none, and fails
    the publish with WeightSyncError, alive (this test's process is rank 0)."""
    s = WeightSender(WeightSyncConfig(host="127.0.0.1", timeout_s=3.0))
    try:
        store = dist.PrefixStore("g9", s.store)
        rank0 = lambda: Group(Where("g9", 0, 2, 3.0, "rank 1"), store, "gloo", CPU)  # noqa: E731
        t0, group0 = in_thread(rank0)
        client = dist.TCPStore("127.0.0.1", s.store.port, is_master=False, wait_for_workers=False)
        rogue = Group(Where("g9", 1, 2, 3.0, "rank 0"), dist.PrefixStore("g9", client), "gloo", CPU)
        t0.join(30)

        def answer_with_a_flood() -> None:
            nonce = torch.zeros(16, dtype=torch.uint8)
            rogue.broadcast(nonce, "token challenge")
            big = torch.ones(1 << 20, dtype=torch.uint8)
            rogue.pg.allgather([[torch.zeros_like(big), torch.zeros_like(big)]], [big])

        t1, _ = in_thread(answer_with_a_flood)
        with pytest.raises(WeightSyncError, match=r"rank\(s\) \[1\] did not prove"):
            group0["result"].authenticate("tok")
        t1.join(30)
        group0["result"].close(ok=False)
        rogue.close(ok=False)
    finally:
        s.close()


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_with_a_correct_digest_never_reach_the_engine(sender, value) -> None:
    """A rank 0 that sends NaN or inf with a digest that matches them (a learner of
    another version, or a broken one): the bucket holding them is refused before `load`
    sees it, so no engine (hf, SGLang, vLLM's workers) makes them live."""
    state = model()
    state[3][1][0] = value  # b.bias: in the fp32 bucket, which comes second
    thread, _out = in_thread(lambda: sender.publish("g9", 2, state, 10.0))
    receiver = WeightReceiver()
    loaded, error = receive(receiver, join(sender, "g9"), expected_of(state, "m"))
    thread.join(30)
    receiver.close()
    assert isinstance(error, WeightSyncError) and "NaN or inf in b.bias" in str(error)
    assert "not making them live" in str(error)
    assert [n for n, _ in loaded] == ["b.weight"]  # the bf16 bucket only: finite
    assert all(torch.isfinite(t).all() for _, t in loaded)


def test_a_model_fingerprinted_on_several_threads_is_fingerprinted_the_same() -> None:
    """digest_of hashes a model's worth of tensors on one thread per CPU; the fingerprint
    is the one the per-tensor Digest.add gives (what the learner sends), names and dtypes
    included, a repeated name counting once (its last tensor)."""
    from drmas.transports.digest import PARALLEL_BYTES, Digest, digest_of

    g = torch.Generator().manual_seed(0)
    named = [(f"layer{i}.weight", torch.randn(1 << 20, generator=g)) for i in range(20)]
    named += [("embed", torch.randn(PARALLEL_BYTES // 4, generator=g).to(torch.bfloat16)),
              ("layer3.weight", torch.zeros(4))]  # fmt: skip
    serial = Digest()
    for name, tensor in named:
        serial.add(name, tensor)
    assert digest_of(named) == serial.hexdigest()
    flipped = [(n, t.clone()) for n, t in named]
    flipped[5][1][7] += 1.0
    assert digest_of(flipped) != serial.hexdigest()
