"""Idle CPUs lent between the processes `drmas train` starts on one CPU machine.

An asynchronous run splits the CPUs evenly among its learner ranks and actors
(drmas/launch/train.py, thread_plan), because they may compute at the same time. Often
they do not: an actor that waits for the next weights leaves its share idle while the
learner trains, and a learner waiting for a batch leaves its own idle while the actor
generates. On 2 cores a SmolLM2 learner took 42 s a step on its 1 thread while the actor
waited 54 % of the run.

So each process of the run marks, in one byte of its own file in
RUN_DIR/cpu_share/<host>/<pid>, whether it is computing now (`busy`), and before each
decoder layer (learner, forward and backward) or decode step (actor's hf engine) takes
the machine's CPUs divided by the number of processes computing at that moment (itself
included): all of them when it computes alone, its even share when the others compute too.
Who writes: the learner (drmas/learners/main.py, around a step) and the actor loop
(drmas/actors/main.py, while groups run). Who reads: the same processes, through `adjust`
(drmas/learners/trainer.py's layer hooks, drmas/actors/engines/hf.py's step).

`drmas train` turns it on (DRMAS_CPU_SHARE=<folder>) for asynchronous runs on CPUs whose
processes all run on this machine, unless DRMAS_TORCH_THREADS or learner.threads fix the
threads. A process that died with its mark set is not counted (its pid is gone).
torch's thread count belongs to the calling thread (OpenMP), so `adjust` sets it for the
thread that computes.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drmas.threads import CPU_SHARE as VARIABLE

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHECK_S = 0.02
"""At most this often a process re-reads the others' marks (a few preads)."""
SCAN_S = 1.0
"""How often it looks for processes that started or ended."""


def machine_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


class CpuShare:
    """This process's mark in `folder`, and the thread count it should use now."""

    def __init__(self, folder: Path, cpus: int | None = None) -> None:
        import torch  # here, not at import: the launcher imports this module's users

        self._torch = torch
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        self.cpus = cpus or machine_cpus()
        self.pid = os.getpid()
        self.path = folder / str(self.pid)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwrite(self.fd, b"0", 0)
        self.busy = False
        self.others: dict[int, int] = {}  # pid -> open file of its mark
        self.last_check = self.last_scan = float("-inf")

    # ------------------------------------------------------------------ marks
    def set_busy(self, busy: bool) -> None:
        """Mark this process computing (True) or waiting (False); a write only on change."""
        if busy == self.busy:
            return
        self.busy = busy
        os.pwrite(self.fd, b"1" if busy else b"0", 0)

    def computing(self) -> int:
        """Processes of the run computing now, this one included when it is busy."""
        now = time.monotonic()
        if now - self.last_scan >= SCAN_S:
            self._scan()
            self.last_scan = now
        count = int(self.busy)
        for pid, fd in list(self.others.items()):
            try:
                count += os.pread(fd, 1, 0) == b"1"
            except OSError:  # removed under us: the process ended
                self._forget(pid)
        return count

    def threads_now(self) -> int:
        return max(1, self.cpus // max(1, self.computing()))

    def adjust(self) -> None:
        """Set the calling thread's torch threads to its share now (throttled to CHECK_S)."""
        now = time.monotonic()
        if now - self.last_check < CHECK_S:
            return
        self.last_check = now
        threads = self.threads_now()
        if threads != self._torch.get_num_threads():
            self._torch.set_num_threads(threads)

    def close(self) -> None:
        for pid in list(self.others):
            self._forget(pid)
        try:
            os.close(self.fd)
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    # ------------------------------------------------------------------ inside
    def _scan(self) -> None:
        seen: set[int] = set()
        for entry in os.scandir(self.folder):
            if not entry.name.isdigit() or int(entry.name) == self.pid:
                continue
            pid = int(entry.name)
            if not _alive(pid):
                continue
            seen.add(pid)
            if pid not in self.others:
                try:
                    self.others[pid] = os.open(entry.path, os.O_RDONLY)
                except OSError:
                    continue
        for pid in set(self.others) - seen:
            self._forget(pid)

    def _forget(self, pid: int) -> None:
        fd = self.others.pop(pid, None)
        if fd is not None:
            os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, not ours to signal
        return True
    return True


# ---------------------------------------------------------------------- the process's own
_share: CpuShare | None = None


def start_from_env() -> CpuShare | None:
    """This process's share when DRMAS_CPU_SHARE names a folder (set by `drmas train`),
    else None; once per process."""
    global _share
    if _share is None and (folder := os.environ.get(VARIABLE, "").strip()):
        _share = CpuShare(Path(folder) / socket.gethostname())
        atexit.register(_share.close)
        log.info("sharing %d CPUs with the run's processes on this machine", _share.cpus)
    return _share


def current() -> CpuShare | None:
    return _share


def set_busy(busy: bool) -> None:
    if _share is not None:
        _share.set_busy(busy)


def adjust() -> None:
    if _share is not None:
        _share.adjust()


@contextlib.contextmanager
def computing() -> Iterator[None]:
    """Marked busy for the block (a learner's step); a no-op when sharing is off."""
    set_busy(True)
    try:
        yield
    finally:
        set_busy(False)


def start_process(threads: int) -> None:
    """Set this process's torch threads, and join the run's CPU share when it has one."""
    import torch

    torch.set_num_threads(threads)
    start_from_env()


def follow_layers(layers: Iterable[torch.nn.Module]) -> int:
    """Adjust before each of `layers`' forward and backward (a model's decoder layers);
    returns how many it follows (0 when sharing is off)."""
    if _share is None:
        return 0
    count = 0
    for layer in layers:
        layer.register_forward_pre_hook(_before_layer)
        layer.register_forward_hook(_after_layer)
        count += 1
    return count


def _before_layer(module: torch.nn.Module, args: Any) -> None:
    adjust()


def _after_layer(module: torch.nn.Module, args: Any, output: Any) -> None:
    """The layer's backward runs when its output's gradient is known: adjust then."""
    out = output[0] if isinstance(output, tuple) and output else output
    if getattr(out, "requires_grad", False) and hasattr(out, "register_hook"):
        out.register_hook(_before_backward)


def _before_backward(grad: torch.Tensor) -> None:
    adjust()
