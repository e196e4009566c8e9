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
