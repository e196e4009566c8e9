"""A learner rank sent SIGTERM tells the broker why, naming its Slurm job, and exits at once
(drmas/learners/leaving.py; issue #26). A real child process and a real ZeroMQ ROUTER in
place of the broker: once with the main thread in a wait the signal interrupts (the
handler leaves), once with it stuck in a C call that the signal does not reach, as a rank
blocked in a torch collective (the watchdog leaves)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import zmq

from drmas.learners.leaving import leave_reason, slurm_job
from drmas.protocol import decode_to_broker
from drmas.protocol.messages import Goodbye, Heartbeat

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import ctypes, signal, sys, time
    from drmas.learners.leaving import Leaving
    from drmas.protocol.messages import Heartbeat
    from drmas.transports.channel import BrokerClient
    from drmas.transports.ports import free_port

    client = BrokerClient(sys.argv[1], "learner-solver-1")
    client.send(Heartbeat("learner-solver-1"))
    Leaving("solver", 1, lambda: client).install()
    if sys.argv[2] == "blocked":  # the signal goes to another thread; libc sleep goes on
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        print("ready", flush=True)
        ctypes.CDLL(None).sleep(120)
    else:
        print("ready", flush=True)
        time.sleep(120)
    """
)


def test_the_slurm_job_is_named_as_scontrol_names_it() -> None:
    assert slurm_job({}) == ""
    assert slurm_job({"SLURM_JOB_ID": "812", "SLURM_PROCID": "1"}) == "Slurm job 812 task 1"
    array = {"SLURM_JOB_ID": "815", "SLURM_ARRAY_JOB_ID": "812", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_job(array) == "Slurm job 815 (array 812_3)"
    env = {"SLURM_JOB_ID": "812", "SLURM_PROCID": "0"}
    assert leave_reason(15, env, "gpu03", 42) == "SIGTERM to pid 42 on gpu03, Slurm job 812 task 0"
    assert leave_reason(2, {}, "h", 7) == "SIGINT to pid 7 on h"


def in_c_sleep(pid: int) -> None:
    """Wait until the child's main thread sleeps inside libc (its kernel wait channel)."""
    wchan = Path(f"/proc/{pid}/wchan")
    for _ in range(300):
        try:
            if "nanosleep" in wchan.read_text():
                return
        except OSError:
            break
        time.sleep(0.1)
    pytest.skip(f"{wchan} does not show the child's main thread in its sleep")


@pytest.mark.parametrize("main_thread", ["waiting", "blocked"])
def test_sigterm_sends_a_goodbye_naming_the_job_then_exits(main_thread: str) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    env = {**os.environ, "SLURM_JOB_ID": "812", "SLURM_PROCID": "1", "PYTHONPATH": str(REPO)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, f"tcp://127.0.0.1:{port}", main_thread],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert router.poll(30_000), "the child never connected"
        identity, first = router.recv_multipart()
        heartbeat = decode_to_broker(first)  # the routing id is the ROUTER's: the name is here
        assert isinstance(heartbeat, Heartbeat) and heartbeat.client_id == "learner-solver-1"
        if main_thread == "blocked":
            in_c_sleep(child.pid)  # else the main thread could still catch the signal itself
        child.send_signal(signal.SIGTERM)
        assert child.wait(60) == 128 + signal.SIGTERM
        assert router.poll(5_000), "no Goodbye reached the broker"
        same, frame = router.recv_multipart()
        assert same == identity  # over the connection that sent the heartbeat
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        router.close()
        ctx.term()
    goodbye = decode_to_broker(frame)
    assert isinstance(goodbye, Goodbye) and goodbye.client_id == "learner-solver-1"
    assert (
        goodbye.reason
        == f"SIGTERM to pid {child.pid} on {os.uname().nodename}, Slurm job 812 task 1"
    )
    log = child.stderr.read().decode() if child.stderr else ""
    assert "solver rank 1 leaves now" in log
    blocked_note = "the main thread was blocked" in log
    assert blocked_note == (main_thread == "blocked"), log


def test_a_finished_rank_flushes_its_goodbye_before_it_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Learner.cleanup at the end of a run: the Goodbye leaves before the connection closes.
    Closed at once (linger 0), it was sometimes dropped, and the finished broker waited out
    the rank's heartbeat grace (75 s) before it stopped. Here the broker binds only once the
    Goodbye is queued: a close that drops what is queued never delivers it."""
    from drmas.learners import main as learner_main
    from drmas.transports.channel import BrokerClient
    from drmas.transports.ports import free_port

    port = free_port()
    client = BrokerClient(f"tcp://127.0.0.1:{port}", "learner-solver-0", ctx=zmq.Context())
    queued = threading.Event()
    send = client.send

    def send_then_tell(message: object) -> None:
        send(message)
        queued.set()

    monkeypatch.setattr(client, "send", send_then_tell)
    monkeypatch.setattr(learner_main.dist, "destroy_process_group", lambda: None)
    learner = object.__new__(learner_main.Learner)
    learner.sender, learner._client = None, client
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)

    def broker_comes_up() -> None:
        assert queued.wait(30)
        router.bind(f"tcp://127.0.0.1:{port}")

    up = threading.Thread(target=broker_comes_up)
    up.start()
    try:
        learner.cleanup()
        up.join(30)
        assert router.poll(10_000), "the Goodbye was dropped at close"
        goodbye = decode_to_broker(router.recv_multipart()[1])
    finally:
        router.close()
        ctx.term()
    assert isinstance(goodbye, Goodbye) and goodbye.client_id == "learner-solver-0"
    assert goodbye.reason == ""  # a rank that finished
