"""How a learner rank leaves when it is told to stop (SIGTERM, SIGINT): it tells the
broker, with a Goodbye that says why (the signal, its host and pid, and its Slurm job when
it runs in one), then exits at once with 128 + the signal's number.

Installed by drmas/learners/entry.py around the Learner's whole life, so `drmas learner`,
torchrun's ranks and Slurm learner tasks (drmas/launch/slurm.py; `scancel` sends SIGTERM)
all leave this way. Why: a rank that just dies is noticed only after
broker.learner_timeout_s of silence. Told at once, the broker names the rank and its job,
waits broker.learner_rejoin_s for the seat to be taken back, then stops the run instead of
leaving the actors and the other learners waiting (drmas/broker/seats.py).

The rank does not finish its step: a cancelled job is killed after Slurm's KillWait, and a
checkpoint half written is worth nothing. The Goodbye is sent from the Python signal
handler, in the main thread, so the broker socket is never used by two threads at once.
That handler runs only once the main thread is back in Python, and a rank blocked in a
torch collective may not be back for learner.timeout_s: a watchdog thread, woken through
signal.set_wakeup_fd, leaves in its place after MAIN_THREAD_GRACE_S. The main thread is
then inside torch, not ZeroMQ: a ZeroMQ wait is interrupted by the signal and runs the
handler. Every step of leaving is bounded (GOODBYE_FLUSH_S).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import NoReturn

import zmq

from drmas.protocol.messages import Goodbye
from drmas.transports.channel import BrokerClient, BrokerUnavailable

log = logging.getLogger("drmas.learner")

LEAVING = (signal.SIGTERM, signal.SIGINT)
MAIN_THREAD_GRACE_S = 5.0
"""How long the watchdog lets the main thread's handler leave before leaving itself."""
GOODBYE_FLUSH_S = 2.0
"""Longest wait for the Goodbye to leave the process (queued, then flushed by ZeroMQ)."""


def slurm_job(environ: Mapping[str, str]) -> str:
    """The Slurm job this process runs in, as scontrol and squeue name it ("" outside
    Slurm): "Slurm job 812 task 1", "Slurm job 815 (array 812_3) task 0"."""
    job = environ.get("SLURM_JOB_ID", "").strip()
    if not job:
        return ""
    text = f"Slurm job {job}"
    array, index = environ.get("SLURM_ARRAY_JOB_ID", ""), environ.get("SLURM_ARRAY_TASK_ID", "")
    if array and index:
        text += f" (array {array}_{index})"
    task = environ.get("SLURM_PROCID", "")
    return f"{text} task {task}" if task else text


def leave_reason(signum: int, environ: Mapping[str, str], host: str, pid: int) -> str:
    """What the Goodbye says: "SIGTERM to pid 4242 on gpu03, Slurm job 812 task 1"."""
    where = slurm_job(environ)
    name = signal.Signals(signum).name
    return f"{name} to pid {pid} on {host}" + (f", {where}" if where else "")


class Leaving:
    """The SIGTERM/SIGINT handlers of one learner rank (see the module). `client` returns
    the rank's broker connection, None before it has one."""

    def __init__(self, model: str, rank: int, client: Callable[[], BrokerClient | None]) -> None:
        self.model = model
        self.rank = rank
        self.client = client
        self._lock = threading.Lock()
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._leaving = 0
        """The thread that is leaving (0: none yet)."""

    def install(self) -> None:
        """From the main thread: the handlers, the wakeup fd and the watchdog thread."""
        read, write = socket.socketpair()
        write.setblocking(False)
        self._wakeup = (read, write)
        signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
        for signum in LEAVING:
            signal.signal(signum, self.on_signal)
        threading.Thread(
            target=self.watch, args=(read,), name="learner-leaving", daemon=True
        ).start()

    def uninstall(self) -> None:
        """Back to the defaults once the learner has finished (the watchdog's socket closes,
        which ends it)."""
        for signum in LEAVING:
            signal.signal(signum, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        if self._wakeup is not None:
            read, write = self._wakeup
            write.close()
            read.shutdown(socket.SHUT_RDWR)  # wakes the watchdog's recv (close would not)
            read.close()
            self._wakeup = None

    def on_signal(self, signum: int, _frame: object) -> None:
        if self._leaving == threading.get_ident():
            return  # a second signal (Slurm signals the step and srun) while this thread leaves
        self.leave(signum)

    def watch(self, read: socket.socket) -> None:
        """The watchdog: each byte is a signal's number (written by Python's C handler,
        whatever the main thread is doing)."""
        try:
            while data := read.recv(64):
                signum = next((s for s in data if s in LEAVING), 0)
                if signum:
                    time.sleep(MAIN_THREAD_GRACE_S)  # the main thread's handler exits first
                    self.leave(signum, "the main thread was blocked (in torch?)")
        except OSError:
            return  # uninstalled: the socket closed

    def leave(self, signum: int, note: str = "") -> NoReturn:
        """Goodbye(reason) to the broker, flush the logs, exit 128 + signum."""
        code = 128 + signum
        if not self._lock.acquire(timeout=GOODBYE_FLUSH_S + MAIN_THREAD_GRACE_S):
            os._exit(code)  # the other path is leaving and did not finish: do not wait more
        self._leaving = threading.get_ident()
        reason = leave_reason(signum, os.environ, socket.gethostname(), os.getpid())
        log.warning(
            "%s rank %d leaves now (%s)%s: the broker is told, the step is not finished",
            self.model, self.rank, reason, f"; {note}" if note else "",
        )  # fmt: skip
        client = self.client()
        if client is not None:
            goodbye(client, reason)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def goodbye(client: BrokerClient, reason: str) -> None:
    """Send Goodbye(reason) and wait, at most GOODBYE_FLUSH_S, until ZeroMQ has sent it, then
    close the client and its context. Both ways a rank leaves use it: on a signal (the
    process exits with os._exit, which would drop a message still queued) and at the end of
    its run (Learner.cleanup, reason "": a close at once could drop it too)."""
    sock = client.sock
    context = sock.context
    try:
        sock.setsockopt(zmq.SNDTIMEO, int(GOODBYE_FLUSH_S * 1000))
        client.send(Goodbye(client.client_id, reason=reason[:1000]))
    except (BrokerUnavailable, zmq.ZMQError) as exc:
        log.warning("could not tell the broker (%s): it notices after its timeouts", exc)
    client.close(linger_ms=int(GOODBYE_FLUSH_S * 1000))  # its monitor too: term() waits for all
    flushed = threading.Thread(target=context.term, name="goodbye-flush", daemon=True)
    flushed.start()  # term() returns once the lingering message is sent (or linger ends)
    flushed.join(GOODBYE_FLUSH_S + 0.5)
