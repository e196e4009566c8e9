"""Faults during a real run: an actor SIGKILLed mid-run or in a weight broadcast, garbage
and malformed frames. All of them in one run (each `drmas train` costs CI about a
minute), which is held open until the checks are done: the faulty clients, which take
20-30 s to start on a loaded machine, can never find it already over."""

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
    HELD_OPEN,
    REPO,
    actor_hello,
    broker_address,
    check_accounting,
    read_summary,
    start_train,
    status,
    stop_all,
    stop_run,
    versions,
    wait_for,
)

pytestmark = pytest.mark.slow


def doomed_actor(run_dir: Path, actor_id: str, fault: str, value: str) -> subprocess.Popen[bytes]:
    """An extra `drmas actor` that SIGKILLs itself at the fault its env variable names."""
    return subprocess.Popen(
        [sys.executable, "-m", "drmas.launch.cli", "actor", "--config", str(run_dir / "config.yaml"),
         "--id", actor_id],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, fault: value},
    )  # fmt: skip


def bad_step(vocab_id: int) -> Step:
    return Step(
        agent="solver", model="solver", prompt_ids=pack_ids([1, 2]), response_ids=pack_ids([vocab_id]),
        logprobs=pack_logprobs([-0.1]), version=0, valid=True, finish_reason="stop",
    )  # fmt: skip


def garbage_then_silence(address: str, run_dir: Path) -> None:
    """A client sends garbage and malformed frames, each refused with its reason, then says
    Hello as an actor without the run's actor secret (refused) and with it, takes a lease,
    returns an invalid group and goes silent."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"evil")
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)

        def ask(*frames: bytes):
            sock.send_multipart(list(frames))
            assert sock.poll(60_000), "broker stopped answering"
            return decode_from_broker(sock.recv())

        assert isinstance(ask(b"\x00\xffgarbage"), ErrorReply)
        assert ask(msgpack.packb({"type": "launch_missiles"})).code == "bad_frame"
        assert ask(b"a", b"b").code == "too_many_parts"  # two payload frames
        stranger = ask(encode(LeaseRequest("evil", 1, {})))
        assert stranger.code == "unknown_client"
        unproven = ask(encode(Hello("actor", "evil", PROTOCOL_VERSION, ["solver", "verifier"])))
        assert unproven.code == "forbidden" and "actor.secret" in unproven.reason
        old = actor_hello(run_dir, "evil", ["solver", "verifier"], PROTOCOL_VERSION + 1)
        refusal = ask(encode(old))
        assert refusal.code == "protocol_version" and str(PROTOCOL_VERSION) in refusal.reason
        welcome = ask(encode(actor_hello(run_dir, "evil", ["solver", "verifier"])))
        assert isinstance(welcome, Welcome)
        leases = wait_for(
            lambda: ask(encode(LeaseRequest("evil", 1, {}))).leases,
            240,
            "no lease for the evil actor",
        )
        lease = leases[0]
        episodes = [Episode([bad_step(10**6)], 1.0) for _ in range(lease.group_size)]
        bad = ask(encode(pack_group("evil", lease.lease_id, lease.group_id, episodes)))
        assert bad.code == "invalid" and "vocabulary" in bad.reason
        assert isinstance(ask(encode(LeaseRequest("evil", 1, {}))), (Leases, ErrorReply))
    finally:
        sock.close()  # the evil actor now goes silent: whatever it holds is re-issued
        ctx.term()


def removed_silent(counters: dict[str, int]) -> int:
    """Actors the broker removed without a Goodbye: lost to missed heartbeats, or, when
    three publishes come first, dropped for missing their roll calls (a dead actor never
    checks in; whichever comes first removes it, and both re-issue what it held)."""
    return counters.get("actors_lost", 0) + counters.get("actors_never_joined", 0)


def test_garbage_frames_and_actors_killed_mid_run_or_in_a_broadcast_lose_nothing(
    tmp_path: Path, model_cache: Path
) -> None:
    """Three faults in one run: the garbage-then-silent client above; an extra actor that
    SIGKILLs itself the moment it is granted leases, so it certainly dies holding them
    (killing it from here after `drmas status` showed leases raced with it returning
    them); another that SIGKILLs itself in a weight broadcast, after the first bucket of a
    solver publish at v3 or later arrived (small buckets: a publish of the tiny model is
    several broadcasts). Every bad frame is refused and counted, all three are removed
    for missed heartbeats or roll calls (no Goodbye), what they held is re-issued, and the
    run goes on with nothing lost and nothing counted twice."""
    run_dir = tmp_path / "run"
    train = start_train(
        run_dir, model_cache, HELD_OPEN, "actor.max_groups=2", "weights.bucket_mb=0.25"
    )
    doomed: list[subprocess.Popen[bytes]] = []
    try:
        address = broker_address(run_dir)  # the run's config.yaml is written
        doomed.append(
            doomed_actor(run_dir, "doomed-leases", "DRMAS_FAULT_KILL_HOLDING_LEASES", "1")
        )
        doomed.append(
            doomed_actor(run_dir, "doomed-weights", "DRMAS_FAULT_KILL_IN_WEIGHTS", "solver:3")
        )
        garbage_then_silence(address, run_dir)
        for extra in doomed:  # no Goodbye: only missed heartbeats tell
            wait_for(
                lambda e=extra: e.poll() is not None,
                400,
                "a doomed actor never hit its fault",
                train,
            )
            assert extra.returncode == -signal.SIGKILL
        wait_for(lambda: removed_silent(status(address)["counters"]) == 3, 240,
                 "the broker did not count the three silent clients lost", train)  # fmt: skip
        now = versions(address)  # the run goes on: each model one more version
        wait_for(
            lambda: all(v >= now[m] + 1 for m, v in versions(address).items()),
            300,
            f"the run did not move past {now}",
            train,
        )
        stop_run(train)
    finally:
        stop_all(train, *doomed)
    summary = read_summary(run_dir)
    c = check_accounting(summary)
    assert c["refused/bad_frame"] >= 2 and c["refused/too_many_parts"] == 1
    assert c["refused/unknown_client"] >= 1 and c["refused/protocol_version"] == 1
    assert c["refused/invalid"] >= 1 and c["groups_invalid"] == 1
    assert removed_silent(c) == 3 and c["leases_reissued"] >= 1, (summary, run_dir)
    assert summary["versions"]["solver"] >= 4, summary["versions"]  # past the v3+ kill
