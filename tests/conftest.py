"""Fixtures and session hooks shared by the unit and the integration tests.

The end of a session is watched, since CI once sat more than 15 minutes after pytest's
summary (until its stage deadline killed it) with nothing saying why:
- whatever the tests left running that would keep this interpreter from exiting (a child
  process, a non-daemon thread) is named with its stack, its processes are killed, and
  the session fails, so the test that leaked it gets found;
- an exit that still takes longer than EXIT_GRACE_S prints every thread's stack and ends
  with the tests' own exit status, so a stall costs minutes, not the CI job.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil
import pytest

LEFTOVER_GRACE_S = 10.0
"""How long a thread or child a test started may take to end after the last test."""
EXIT_GRACE_S = 120
"""After pytest is done: an interpreter exit that takes longer is a stall; it is dumped."""
RESOURCE_TRACKER = "multiprocessing.resource_tracker"
"""multiprocessing's helper process: it lives as long as pytest and ends with it."""
_exit_status = {"code": 0}


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private builtin-model cache for the whole session: each builtin model (the tiny
    ones per warm-start setting, SmolLM2 built from its GGUF file) is built once, by the
    first test that needs it."""
    return tmp_path_factory.mktemp("drmas-cache")


def _blocking_threads() -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t is not threading.current_thread() and t.is_alive() and not t.daemon
    ]


def _leaked(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and RESOURCE_TRACKER not in " ".join(
            proc.cmdline()
        )
    except psutil.Error:
        return False


def _leftovers() -> tuple[list[threading.Thread], list[psutil.Process]]:
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while True:
        threads = _blocking_threads()
        children = [c for c in psutil.Process().children(recursive=True) if _leaked(c)]
        if not (threads or children) or time.monotonic() > deadline:
            return threads, children
        time.sleep(0.5)


def _describe(threads: list[threading.Thread], children: list[psutil.Process]) -> list[str]:
    frames = sys._current_frames()
    lines = []
    for t in threads:
        stack = frames.get(t.ident or -1)
        where = "".join(traceback.format_stack(stack)[-4:]) if stack else "(no frame)\n"
        lines.append(f"non-daemon thread {t.name!r}, at:\n{where}")
    for c in children:
        try:
            lines.append(f"child process {c.pid}: {' '.join(c.cmdline())[:300]}")
        except psutil.Error:
            lines.append(f"child process {c.pid} (gone while being named)")
    return lines


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    threads, children = _leftovers()
    if threads or children:
        _report_and_kill(session, threads, children)
    _exit_status["code"] = int(session.exitstatus)


def _report_and_kill(
    session: pytest.Session, threads: list[threading.Thread], children: list[psutil.Process]
) -> None:
    report = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [
        "the tests left these running after the last test; they would keep pytest from "
        "exiting (the children are killed now; find the test that started them):",
        *_describe(threads, children),
    ]
    if report is not None:
        report.ensure_newline()
    for line in lines:
        if report is not None:
            report.write_line(line, red=True)
        else:
            print(line, file=sys.stderr)
    for c in children:
        with contextlib.suppress(psutil.Error):
            c.kill()
    if session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A watchdog for the interpreter's own exit (thread joins, atexit handlers), and
    SIGTERM back to its default, which a test that ran a server in this process may
    have replaced (a stage deadline's SIGTERM must end pytest)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    threading.Thread(target=_end_a_stalled_exit, name="exit-watchdog", daemon=True).start()
    # the backstop, for a stall where Python threads no longer run
    faulthandler.dump_traceback_later(EXIT_GRACE_S + 60, exit=True, file=2)  # fd 2: stderr


def _end_a_stalled_exit() -> None:
    time.sleep(EXIT_GRACE_S)
    code = _exit_status["code"]
    print(
        f"pytest's exit stalled for {EXIT_GRACE_S} s after its summary; every thread's stack "
        f"follows, then it exits with the tests' status ({code})",
        file=sys.stderr,
        flush=True,
    )
    faulthandler.dump_traceback(file=2, all_threads=True)
    for line in _describe([], psutil.Process().children(recursive=True)):
        print(line, file=sys.stderr, flush=True)
    os._exit(code)
