"""Failures of the team's own code in an actor: its run_episode, its tools, its reward.

    actor loop (drmas/actors/main.py) ── a group's exception / a finished group ──> FailureWatch
    FailureWatch ── the first failure, traceback in full ──> the actor's log
                 ── the same, as JSON ──> RUN_DIR/logs/<actor id>.failure.json
    drmas train (drmas/launch/team_failures.py) ── reads ──> that file: its console shows it

A group that raises hands its lease back (the broker re-leases it), so one transient
failure costs one retry. A bug in the team raises in every group: without a bound the run
would go on for ever, re-leasing groups that always fail, with nothing on the console.
So the first failure is shown in full (file and line in the user's code), later ones
one line each, and after `actor.max_failed_groups` failed groups in a row with no
success between them, failing for at least `actor.min_failing_s`, the actor stops, naming
the team, the exception and where it was raised; `drmas train` then stops the run. The
time floor is for tools: a retriever that restarts fails every group that reaches it,
dozens a second, for a few seconds, and that must not end a long run. Meanwhile a failing
actor asks for leases more slowly (`backoff_s`), so it does not spin the broker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sysconfig
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from drmas.protocol.messages import Episode

log = logging.getLogger("drmas.actor")

REPORT_SUFFIX = ".failure.json"
"""RUN_DIR/logs/<actor id>.failure.json: the actor's first team failure (and, once it
gave up, how many groups failed in a row)."""
STOP_EXIT_CODE = 3
"""The exit code of an actor that stopped because its team kept failing."""

_DRMAS_DIR = Path(__file__).resolve().parents[1]
_LIBRARY_DIRS = tuple(
    Path(p).resolve()
    for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
)


@dataclass
class Failure:
    """One exception of a team's group, as shown on the console and written to the report."""

    team: str
    actor: str
    exception: str
    """`Type: message`, with the notes drmas adds (which tool or reward function raised)."""
    where: str
    """`file:line in function` of the deepest frame in the user's code (else the deepest)."""
    traceback: str
    failed_groups: int = 1
    """Failed groups in a row when this was written."""
    failing_s: float = 0.0
    """Seconds since the first of them."""
    stopped: bool = False
    """True once the actor gave up on the team."""

    @property
    def signature(self) -> str:
        """What makes two failures the same bug: the exception type and where it was raised."""
        return f"{self.exception.split(':', 1)[0]} at {self.where}"

    def stop_message(self) -> str:
        return (
            f"the {self.team} team failed {self.failed_groups} groups in a row in "
            f"{self.failing_s:.0f} s on {self.actor}, each with an exception in its code; "
            f"the last one: {self.exception} "
            f"(raised at {self.where}). Fix the team's code and run again."
        )


def describe(exc: BaseException, team: str, actor: str) -> Failure:
    """The failure of one group: its exception, where in the user's code, the traceback."""
    notes = [str(n) for n in getattr(exc, "__notes__", ())]
    text = f"{type(exc).__name__}: {exc}" + "".join(f" ({n})" for n in notes)
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if _is_user_file(f.filename)]
    chosen = mine or list(frames)
    frame = chosen[-1] if chosen else None
    where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "unknown"
    full = "".join(traceback.format_exception(exc))
    return Failure(team, actor, text, where, full)


def _is_user_file(filename: str) -> bool:
    """Not drmas itself, not the standard library, not an installed package."""
    path = Path(filename).resolve()
    if path.is_relative_to(_DRMAS_DIR):
        return False
    return not any(path.is_relative_to(lib) for lib in _LIBRARY_DIRS)


class FailureWatch:
    """Counts failed groups in a row; logs the first failure of each kind in full."""

    def __init__(
        self,
        team: str,
        actor: str,
        limit: int,
        report: Path | None,
        min_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`limit`: failed groups in a row after which the actor gives up (0 = never), once
        they have gone on for `min_seconds`; `report`: where the first failure is written
        for `drmas train` (None: log only)."""
        self.team = team
        self.actor = actor
        self.limit = limit
        self.min_seconds = min_seconds
        self.clock = clock
        self.report = report
        self.in_a_row = 0
        self.since = 0.0
        """When the first failure of the current row was counted (clock time)."""
        self.first: Failure | None = None
        self.last: Failure | None = None
        self.shown: set[str] = set()

    def succeeded(self) -> None:
        """A group came back: the team's code works, so earlier failures were transient."""
        self.in_a_row = 0

    def failed(self, exc: BaseException, group_id: int) -> bool:
        """Count one failed group (its lease is handed back by the caller); True when the
        actor should stop: `limit` groups failed in a row, over at least `min_seconds`."""
        if self.in_a_row == 0:
            self.since = self.clock()
        self.in_a_row += 1
        failure = describe(exc, self.team, self.actor)
        self.last = failure
        if failure.signature not in self.shown and len(self.shown) < 8:
            self.shown.add(failure.signature)
            log.error(
                "group %d failed in the %s team's code, at %s; its lease is handed back. "
                "The full traceback (shown once; later failures of this kind take one line "
                "each):\n%s",
                group_id, self.team, failure.where, failure.traceback.rstrip(),
            )  # fmt: skip
        else:
            log.error(
                "group %d failed: %s at %s (%d in a row); handing the lease back",
                group_id, failure.exception, failure.where, self.in_a_row,
            )  # fmt: skip
        if self.first is None:
            self.first = failure
            self.write(failure)
        return 0 < self.limit <= self.in_a_row and self.failing_s() >= self.min_seconds

    def failing_s(self) -> float:
        return self.clock() - self.since if self.in_a_row else 0.0

    def backoff_s(self) -> float:
        """How long to wait before asking for more leases: 0 while groups succeed, then
        0.1, 0.2, 0.4 s ... up to 1 s as failures go on in a row."""
        return 0.0 if self.in_a_row == 0 else min(1.0, 0.05 * 2.0 ** min(self.in_a_row, 5))

    def gave_up(self) -> Failure:
        """The failure the actor stops with: the last one, counted; also written."""
        assert self.last is not None, "gave_up() follows a failed() that returned True"
        failure = self.last
        failure.failed_groups, failure.failing_s = self.in_a_row, self.failing_s()
        failure.stopped = True
        self.write(failure)
        return failure

    def write(self, failure: Failure) -> None:
        """The report file, replaced whole (a reader never sees half of it)."""
        if self.report is None:
            return
        tmp = self.report.with_name(self.report.name + ".tmp")
        try:
            tmp.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(asdict(failure), indent=2) + "\n")
            os.replace(tmp, self.report)
        except OSError as exc:  # the log has it all the same
            log.warning("could not write %s: %s", self.report, exc)


def report_path(run_dir: str, actor_id: str) -> Path | None:
    """RUN_DIR/logs/<actor id>.failure.json, or None for an actor with no run folder."""
    if not run_dir:
        return None
    return Path(run_dir) / "logs" / f"{actor_id.replace('/', '_')}{REPORT_SUFFIX}"


def read_report(path: Path) -> Failure | None:
    """A report as written by FailureWatch, or None when unreadable (being replaced)."""
    try:
        data = json.loads(path.read_text())
        return Failure(**data)
    except (OSError, ValueError, TypeError):
        return None


def group_failure(task: asyncio.Task[list[Episode]]) -> BaseException | None:
    """What ended a finished episode task, None if it returned. A task cancelled from
    inside (the team's code cancelled itself or awaited something cancelled) is a failed
    group too: its lease goes back, counted like an exception (asking a cancelled task
    for its exception would raise instead)."""
    if task.cancelled():
        return asyncio.CancelledError("the group's task was cancelled before it returned")
    return task.exception()
