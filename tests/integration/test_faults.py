"""Faults during a real run: an actor SIGKILLed mid-run or in a weight broadcast, garbage
and malformed frames."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq

from drmas.protocol import PROTOCOL_VERSION, decode_from_broker, encode, pack_ids, pack_logprobs
from drmas.protocol.messages import (
    Episode,
    ErrorReply,
    Hello,
    LeaseRequest,
    Leases,
    Step,
    Welcome,
    pack_group,
)
from tests.integration.conftest import (
    REPO,
    broker_address,
    finish,
    read_summary,
    start_train,
    stop_all,
    wait_for,
)

pytestmark = pytest.mark.slow


def doomed_actor(run_dir: Path, fault: str, value: str) -> subprocess.Popen[bytes]:
    """An extra `drmas actor` that SIGKILLs itself at the fault its env variable names."""
    return subprocess.Popen(
        [sys.executable, "-m", "drmas.launch.cli", "actor", "--config", str(run_dir / "config.yaml"),
         "--id", "doomed"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, fault: value},
    )  # fmt: skip


def test_actor_killed_during_a_weight_broadcast_loses_nothing(
    tmp_path: Path, model_cache: Path
) -> None:
    run_dir, steps = tmp_path / "run", 16
    # small buckets: the tiny model's publish is several broadcasts, so the kill lands
    # between them (after the first bucket of a solver publish at v3 or later arrived).
    # 16 steps: the doomed actor takes ~20-30 s to start on a loaded machine, and a 6-step
    # run once ended in 21 s, before it said Hello
    train = start_train(
        run_dir, model_cache, f"train.steps={steps}", "actor.max_groups=4",
        "weights.bucket_mb=0.25",
    )  # fmt: skip
    extra = None
    try:
        broker_address(run_dir)
        extra = doomed_actor(run_dir, "DRMAS_FAULT_KILL_IN_WEIGHTS", "solver:3")
        assert extra.wait(timeout=400) == -signal.SIGKILL  # it died in the broadcast
        finish(train)
    finally:
        stop_all(train, extra)
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c["actors_lost"] == 1, (summary, run_dir)
    assert summary["leases"]["balanced"] == 1, summary["leases"]
    assert c.get("groups_trained_twice", 0) == 0
    assert c.get("weight_digest_mismatch", 0) == 0
    assert summary["versions"] == {"solver": steps, "verifier": steps}
    for model in ("solver", "verifier"):
        assert summary["trained_groups"][model] == steps * 4  # every batch whole, none twice


def bad_step(vocab_id: int) -> Step:
    return Step(
        agent="solver", model="solver", prompt_ids=pack_ids([1, 2]), response_ids=pack_ids([vocab_id]),
        logprobs=pack_logprobs([-0.1]), version=0, valid=True, finish_reason="stop",
    )  # fmt: skip


def test_garbage_frames_are_refused_and_an_actor_killed_mid_run_loses_nothing(
    tmp_path: Path, model_cache: Path
) -> None:
    """One run, two faults (each run costs CI a minute): a client sends garbage and
    malformed frames, then holds a lease and goes silent; an extra actor is SIGKILLed while
    it holds leases. Every bad frame is refused and counted, both are lost to missed
    heartbeats, what they held is re-issued, and the run completes with nothing lost."""
    run_dir, steps = tmp_path / "run", 6
    train = start_train(run_dir, model_cache, f"train.steps={steps}", "actor.max_groups=2")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"evil")
    sock.setsockopt(zmq.LINGER, 0)
    extra = None
    try:
        address = broker_address(run_dir)  # the run's config.yaml is written
        # The extra actor SIGKILLs itself the moment it is granted leases, so it certainly
        # dies holding them (killing it from here after `drmas status` showed leases raced
        # with it returning them: a CI run saw it hold none by the time the kill landed).
        extra = doomed_actor(run_dir, "DRMAS_FAULT_KILL_HOLDING_LEASES", "1")
        sock.connect(address)

        def ask(*frames: bytes):
            sock.send_multipart(list(frames))
            assert sock.poll(30_000), "broker stopped answering"
            return decode_from_broker(sock.recv())

        assert isinstance(ask(b"\x00\xffgarbage"), ErrorReply)
        assert ask(msgpack.packb({"type": "launch_missiles"})).code == "bad_frame"
        assert ask(b"a", b"b").code == "too_many_parts"  # two payload frames
        stranger = ask(encode(LeaseRequest("evil", 1, {})))
        assert stranger.code == "unknown_client"
        old = Hello("actor", "evil", PROTOCOL_VERSION + 1, ["solver", "verifier"])
        refusal = ask(encode(old))
        assert refusal.code == "protocol_version" and str(PROTOCOL_VERSION) in refusal.reason
        welcome = ask(encode(Hello("actor", "evil", PROTOCOL_VERSION, ["solver", "verifier"])))
        assert isinstance(welcome, Welcome)
        leases = wait_for(
            lambda: ask(encode(LeaseRequest("evil", 1, {}))).leases,
            120,
            "no lease for the evil actor",
        )
        lease = leases[0]
        episodes = [Episode([bad_step(10**6)], 1.0) for _ in range(lease.group_size)]
        bad = ask(encode(pack_group("evil", lease.lease_id, lease.group_id, episodes)))
        assert bad.code == "invalid" and "vocabulary" in bad.reason
        assert isinstance(ask(encode(LeaseRequest("evil", 1, {}))), (Leases, ErrorReply))
        sock.close()
        # the evil actor now goes silent: whatever it holds is re-issued
        wait_for(lambda: extra.poll() is not None, 240, "the extra actor was never granted leases")
        assert extra.returncode == -signal.SIGKILL  # no Goodbye: only missed heartbeats tell
        finish(train)
    finally:
        sock.close()
        ctx.term()
        stop_all(train, extra)
    summary = read_summary(run_dir)
    c = summary["counters"]
    assert c["refused/bad_frame"] >= 2 and c["refused/too_many_parts"] == 1
    assert c["refused/unknown_client"] >= 1 and c["refused/protocol_version"] == 1
    assert c["refused/invalid"] >= 1 and c["groups_invalid"] == 1
    assert c["actors_lost"] == 2 and c["leases_reissued"] >= 1, (summary, run_dir)
    assert summary["leases"]["balanced"] == 1, summary["leases"]
    assert c.get("groups_trained_twice", 0) == 0
    for model in ("solver", "verifier"):
        assert summary["trained_groups"][model] == steps * 4  # every batch whole, none twice
