"""Idle CPUs lent between an asynchronous CPU run's processes (drmas/cpu_share.py): the
count of processes computing is read from other real processes' marks, a dead process's
mark is not counted, the calling thread's torch threads follow it at every decoder layer
(forward and backward), and `drmas train` turns it on only where it belongs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from drmas import cpu_share
from drmas.config import load_config
from drmas.cpu_share import CpuShare
from drmas.launch.train import cpu_share_env

CHILD = """
import sys
from pathlib import Path
from drmas.cpu_share import CpuShare
share = CpuShare(Path(sys.argv[1]), cpus=4)
print("ready", flush=True)
for line in sys.stdin:
    share.set_busy(line.strip() == "busy")
    print("done", flush=True)
"""


class Child:
    """Another process of the run with its own mark, told over stdin to compute or wait."""

    def __init__(self, folder: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(folder)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def mark(self, state: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(state + "\n")
        self.proc.stdin.flush()
        assert self._line() == "done"  # written before it answers

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


def fresh(share: CpuShare) -> int:
    share.last_scan = float("-inf")  # look for processes now, not in SCAN_S
    return share.threads_now()


def test_a_process_takes_every_cpu_while_the_others_wait(tmp_path: Path) -> None:
    share = CpuShare(tmp_path, cpus=4)
    child = Child(tmp_path)
    try:
        share.set_busy(True)
        assert fresh(share) == 4  # the other process waits
        child.mark("busy")
        assert fresh(share) == 2  # both compute: the even share
        assert share.computing() == 2
        child.mark("idle")
        assert fresh(share) == 4
        child.mark("busy")
        assert fresh(share) == 2
        child.kill()  # died with its mark set: its pid is gone, so it is not counted
        assert fresh(share) == 4
    finally:
        if child.proc.poll() is None:
            child.kill()
        share.close()
    assert not share.path.exists()


def test_more_processes_than_cpus_get_one_thread_each(tmp_path: Path) -> None:
    share = CpuShare(tmp_path, cpus=2)
    children = [Child(tmp_path) for _ in range(2)]
    try:
        share.set_busy(True)
        for c in children:
            c.mark("busy")
        assert fresh(share) == 1  # 2 // 3 is 0: never fewer than one thread
    finally:
        for c in children:
            c.kill()
        share.close()


def test_marks_of_files_that_are_not_pids_are_ignored(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("1")
    (tmp_path / str(2**22 + 12345)).write_text("1")  # beyond pid_max: no such process
    share = CpuShare(tmp_path, cpus=2)
    try:
        share.set_busy(True)
        assert fresh(share) == 2
    finally:
        share.close()


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_threads_follow_the_share_at_every_layer_forward_and_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = torch.get_num_threads()
    share = CpuShare(tmp_path, cpus=2)
    monkeypatch.setattr(cpu_share, "_share", share)
    monkeypatch.setattr(cpu_share, "CHECK_S", 0.0)
    calls: list[str] = []
    real = share.adjust

    def counted() -> None:
        calls.append("adjust")
        real()

    monkeypatch.setattr(share, "adjust", counted)
    model = Tiny()
    assert cpu_share.follow_layers(model.layers) == 3
    child = Child(tmp_path)
    try:
        torch.set_num_threads(1)
        with cpu_share.computing():
            assert share.busy
            model(torch.randn(4, 8)).sum().backward()
            assert len(calls) == 6  # before each layer's forward and each one's backward
            assert torch.get_num_threads() == 2  # alone: both CPUs
            child.mark("busy")
            share.last_scan = float("-inf")
            model(torch.randn(4, 8)).sum().backward()
            assert torch.get_num_threads() == 1  # the other computes too
        assert not share.busy
        with torch.no_grad():  # no backward: only the forward hooks
            calls.clear()
            model(torch.randn(4, 8))
            assert len(calls) == 3
    finally:
        child.kill()
        share.close()
        torch.set_num_threads(threads)


def test_the_thread_count_is_the_calling_threads(tmp_path: Path) -> None:
    """torch's threads are per OS thread (OpenMP): an engine's worker thread sets its own."""
    threads = torch.get_num_threads()
    share = CpuShare(tmp_path, cpus=2)
    seen: list[int] = []

    def worker() -> None:
        torch.set_num_threads(1)
        share.adjust()
        seen.append(torch.get_num_threads())

    try:
        share.set_busy(True)
        t = threading.Thread(target=worker)
        t.start()
        t.join(timeout=30)
        assert seen == [2]
    finally:
        share.close()
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("overrides", "env", "shared"),
    [
        ([], {}, True),  # asynchronous CPU run
        (["algorithm.max_staleness=0"], {}, False),  # each side has every CPU in turn
        (["learner.threads=1"], {}, False),  # a fixed count is what was asked for
        ([], {"DRMAS_TORCH_THREADS": "1"}, False),
    ],
)
def test_drmas_train_shares_cpus_only_in_asynchronous_cpu_runs_with_free_threads(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    overrides: list[str],
    env: dict[str, str],
    shared: bool,
) -> None:
    monkeypatch.delenv("DRMAS_TORCH_THREADS", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    got = cpu_share_env(load_config(overrides), tmp_path, None)
    assert got == ({"DRMAS_CPU_SHARE": str(tmp_path / "cpu_share")} if shared else {})


def test_a_gpu_placement_never_shares(tmp_path: Path) -> None:
    class Placed:  # any placement: the run has GPUs
        pass

    assert cpu_share_env(load_config([]), tmp_path, Placed()) == {}  # type: ignore[arg-type]


def test_start_from_env_marks_a_file_per_host_and_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRMAS_CPU_SHARE", str(tmp_path))
    monkeypatch.setattr(cpu_share, "_share", None)
    try:
        share = cpu_share.start_from_env()
        assert share is not None and cpu_share.start_from_env() is share
        assert share.path.parent.parent == tmp_path
        assert share.path.name == str(os.getpid())
        cpu_share.set_busy(True)
        assert share.path.read_bytes() == b"1"
        cpu_share.set_busy(False)
        assert share.path.read_bytes() == b"0"
    finally:
        if cpu_share._share is not None:
            cpu_share._share.close()
        monkeypatch.setattr(cpu_share, "_share", None)
