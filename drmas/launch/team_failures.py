"""`drmas train`'s view of failures in the team's code, which run in the actors.

    actors ── write ──> RUN_DIR/logs/<actor id>.failure.json (drmas/actors/failures.py)
    drmas train's watch loop (drmas/launch/train.py) ── polls ──> FailureReports ── console

The actors' logs are files, so without this a team that raises in every episode would
show nothing on the console. The first failure is printed once, traceback in full; an
actor that fails the same way later adds one line; an actor that gave up on its team
(actor.max_failed_groups failed groups in a row) is named with the team, the exception
and where it was raised when the launcher stops the run.
"""

from __future__ import annotations

import sys
from pathlib import Path

from drmas.actors.failures import REPORT_SUFFIX, Failure, read_report


class FailureReports:
    """Prints each new kind of team failure once; remembers what each actor reported."""

    def __init__(self, log_dir: Path) -> None:
        """Made before the actors start: reports an earlier `drmas train` left in this run
        folder (a resumed run) are removed, so only this run's are shown."""
        self.log_dir = log_dir
        self.by_actor: dict[str, Failure] = {}
        self.shown: set[str] = set()
        for old in log_dir.glob(f"*{REPORT_SUFFIX}"):
            old.unlink(missing_ok=True)

    def poll(self) -> None:
        """Print what the actors reported since the last poll."""
        for path in sorted(self.log_dir.glob(f"*{REPORT_SUFFIX}")):
            if path.name[: -len(REPORT_SUFFIX)] in self.by_actor:
                continue  # that actor's first failure is out already
            failure = read_report(path)
            if failure is None:
                continue  # being written: next poll
            self.by_actor[path.name[: -len(REPORT_SUFFIX)]] = failure
            self.show(failure)

    def show(self, failure: Failure) -> None:
        if failure.signature in self.shown:
            print(
                f"drmas train: {failure.actor}: the same failure in the {failure.team} team's "
                f"code ({failure.signature}); its leases are handed back",
                file=sys.stderr,
                flush=True,
            )
            return
        self.shown.add(failure.signature)
        print(
            f"drmas train: a group failed in the {failure.team} team's code on {failure.actor}, "
            f"at {failure.where}; its lease is handed back. The traceback (shown once):\n"
            f"{failure.traceback.rstrip()}",
            file=sys.stderr,
            flush=True,
        )

    def gave_up(self, actor: str) -> Failure | None:
        """The final report of `actor` (a child name, e.g. actor-0) if it stopped because
        its team kept failing; else None."""
        self.poll()
        report = read_report(self.log_dir / f"{actor}{REPORT_SUFFIX}")
        return report if report is not None and report.stopped else None
