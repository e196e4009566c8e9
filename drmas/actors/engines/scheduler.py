"""The request scheduler the in-process engines share (hf.py, sim.py).

Who talks to whom: workflow coroutines call the engine's `generate`, which hands the
request to `RequestScheduler.submit`; the actor process calls the engine's `pause`,
`resume` and `close`, which land here too. One background task (`run`) owns the model:
each iteration it admits pending requests while the running batch has room and lets the
engine run one step over them (a `Stepper`: prefill the newcomers, decode every running
row, resolve finished rows). The engines differ only in what a step costs and computes;
queueing, admission, pause/resume and shutdown are this one piece of code, so the `sim`
engine the asynchrony benchmarks run on behaves as `hf` does.

Pause semantics ("keep"): `pause()` returns once the loop stands between two steps; in-flight
rows keep their state and continue after `resume()` (with whatever weights were loaded
meanwhile). Requests submitted while paused queue up and are admitted after resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from drmas.actors.engines.base import GenerateRequest, GenerateResult, check_request

log = logging.getLogger("drmas.engine.scheduler")


@dataclass(eq=False)
class Row:
    """One request from admission to its result."""

    request: GenerateRequest
    future: asyncio.Future[GenerateResult]
    version: int = 0
    """Weight version when the row was admitted (set by the engine's prefill)."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class Stepper(Protocol):
    """What an engine gives the scheduler: its running rows and one step over them."""

    def running(self) -> list[Row]:
        """Rows in the running batch (admitted, not finished)."""
        ...

    def room(self) -> int:
        """How many pending requests may join the running batch now."""
        ...

    async def step(self, newcomers: list[Row]) -> None:
        """Admit `newcomers` (may be empty), run one decode step over the running batch,
        resolve the rows that finished. Raising fails the newcomers and the running rows
        (the scheduler then calls `clear_running`); the engine keeps serving."""
        ...

    def clear_running(self) -> None:
        """Forget the running batch (its rows were failed by the scheduler)."""
        ...


class RequestScheduler:
    """Pending queue, admission, pause/resume and shutdown around an engine's step."""

    def __init__(self, kind: str, name: str, stepper: Stepper) -> None:
        self.kind = kind
        """The engine's name (hf, sim): names the loop's task."""
        self.name = name
        """The model the engine serves: named in every error."""
        self._stepper = stepper
        self._pending: deque[Row] = deque()
        self._admitting: list[Row] = []
        """Rows taken from the queue for the step now running (a step that awaits may be
        cancelled by close(); these callers must still be answered)."""
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._wake = asyncio.Event()
        self._hold = False
        self._held = asyncio.Event()
        self._resumed = asyncio.Event()

    @property
    def num_pending(self) -> int:
        """Requests waiting for room in the running batch."""
        return len(self._pending)

    def start(self) -> None:
        """Start the scheduling loop (the engine has loaded its model)."""
        self._task = asyncio.create_task(self._loop(), name=f"{self.kind}-engine:{self.name}")
        self._task.add_done_callback(self._on_loop_exit)

    async def submit(
        self, request: GenerateRequest, vocab_size: int, version: int
    ) -> GenerateResult:
        """Queue one request and wait for its result. `version`: the engine's weights now
        (what a request for zero tokens reports, as it never reaches a step)."""
        if self._closed:
            raise RuntimeError("engine closed")
        if self._task is None:
            raise RuntimeError(f"engine {self.name!r}: call start() before generate()")
        if self._task.done():
            raise RuntimeError(f"engine {self.name!r}: scheduler stopped")
        check_request(request, vocab_size)
        if request.max_new_tokens == 0:
            return GenerateResult([], [], "length", version)
        future: asyncio.Future[GenerateResult] = asyncio.get_running_loop().create_future()
        self._pending.append(Row(request, future))
        self._wake.set()
        return await future

    async def pause(self) -> None:
        """Return once the loop holds between two steps (at once if it is not running)."""
        self._hold = True
        self._resumed.clear()
        if self._task is None or self._task.done():
            return
        self._wake.set()
        await self._held.wait()

    async def resume(self) -> None:
        self._hold = False
        self._resumed.set()

    async def close(self) -> None:
        """Stop the loop; every request not yet answered fails with "engine closed"."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(RuntimeError("engine closed"))

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        """A scheduler that died of a bug must not leave callers waiting forever."""
        if task.cancelled() or task.exception() is None:
            return
        self._fail_all(
            RuntimeError(f"engine {self.name!r} scheduler stopped: {task.exception()!r}")
        )

    def _fail_all(self, error: BaseException) -> None:
        rows = [*self._pending, *self._admitting, *self._stepper.running()]
        self._pending.clear()
        self._admitting = []
        self._stepper.clear_running()
        fail(rows, error)

    async def _loop(self) -> None:
        while True:
            if self._hold:
                self._held.set()
                await self._resumed.wait()
                continue
            self._held.clear()
            if not self._pending and not self._stepper.running():
                self._wake.clear()
                await self._wake.wait()
                continue
            self._admitting = self._take_pending()
            try:
                await self._stepper.step(self._admitting)
            except Exception as exc:
                log.exception("%s: generation step failed", self.name)
                fail([*self._admitting, *self._stepper.running()], exc)
                self._stepper.clear_running()
            self._admitting = []
            await asyncio.sleep(0)

    def _take_pending(self) -> list[Row]:
        room = self._stepper.room()
        taken: list[Row] = []
        while self._pending and len(taken) < room:
            row = self._pending.popleft()
            if not row.future.done():  # the caller gave up waiting
                taken.append(row)
        return taken


def hit_stop(tokenizer: Any, row: Row) -> bool:
    """Whether the row's decoded response contains one of its stop strings. Decodes only
    the tail that could hold one: each token is at least one byte, a character at most four."""
    stops = row.request.stop
    window = 4 * max(len(s) for s in stops) + 8
    text = tokenizer.decode(row.tokens[-window:], skip_special_tokens=True)
    return any(s in text for s in stops)


def fail(rows: Iterable[Row], error: BaseException) -> None:
    """Answer every row not answered yet with `error`."""
    for row in rows:
        if not row.future.done():
            row.future.set_exception(error)
