"""The request scheduler the hf and sim engines share, against a scripted step: admission
by room, pause between steps, close while a step awaits, a failing step, callers that
gave up. Steps are counted, never timed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from drmas.actors.engines.base import GenerateRequest, GenerateResult
from drmas.actors.engines.scheduler import RequestScheduler, Row

T = TypeVar("T")
VOCAB = 100


class CountingStepper:
    """Each step admits the newcomers and gives every running row one token (id 7, log-prob
    -1); a row ends at max_new_tokens. `gate`, when set, makes a step wait on it first."""

    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self.rows: list[Row] = []
        self.admitted: list[int] = []
        """How many newcomers each step admitted."""
        self.gate: asyncio.Event | None = None
        self.entered = asyncio.Event()
        self.fail_next: Exception | None = None

    def running(self) -> list[Row]:
        return self.rows

    def room(self) -> int:
        return self.max_batch - len(self.rows)

    def clear_running(self) -> None:
        self.rows = []

    async def step(self, newcomers: list[Row]) -> None:
        self.admitted.append(len(newcomers))
        self.rows.extend(newcomers)
        self.entered.set()
        if self.gate is not None:
            await asyncio.wait_for(self.gate.wait(), 10)
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        live = []
        for row in self.rows:
            row.tokens.append(7)
            row.logprobs.append(-1.0)
            if len(row.tokens) < row.request.max_new_tokens:
                live.append(row)
            else:
                row.future.set_result(GenerateResult(row.tokens, row.logprobs, "length", 0))
        self.rows = live


def request(n: int) -> GenerateRequest:
    return GenerateRequest([1, 2], temperature=1.0, top_p=1.0, max_new_tokens=n)


def run(body: Callable[[RequestScheduler, CountingStepper], Awaitable[T]], max_batch: int = 4) -> T:
    async def main() -> T:
        stepper = CountingStepper(max_batch)
        scheduler = RequestScheduler("test", "m", stepper)
        scheduler.start()
        try:
            return await body(scheduler, stepper)
        finally:
            await scheduler.close()

    return asyncio.run(asyncio.wait_for(main(), 30))


def test_room_limits_admission_and_rows_share_steps() -> None:
    """max_batch 2, five 3-token requests queued together: the first step admits 2, the
    pair runs 3 steps, then 2 more for 3 steps, then the last one: 9 steps."""

    async def body(
        scheduler: RequestScheduler, stepper: CountingStepper
    ) -> tuple[list[GenerateResult], list[int]]:
        results = await asyncio.gather(*(scheduler.submit(request(3), VOCAB, 0) for _ in range(5)))
        return results, stepper.admitted

    results, admitted = run(body, max_batch=2)
    assert [r.token_ids for r in results] == [[7, 7, 7]] * 5
    assert admitted == [2, 0, 0, 2, 0, 0, 1, 0, 0]


def test_pause_holds_between_steps_and_queued_requests_wait_for_resume() -> None:
    async def body(scheduler: RequestScheduler, stepper: CountingStepper) -> None:
        first = asyncio.create_task(scheduler.submit(request(50), VOCAB, 0))
        await asyncio.wait_for(stepper.entered.wait(), 10)
        await scheduler.pause()
        steps = len(stepper.admitted)
        second = asyncio.create_task(scheduler.submit(request(1), VOCAB, 0))
        for _ in range(20):  # the loop gets every chance to run; it holds
            await asyncio.sleep(0)
        assert len(stepper.admitted) == steps and not first.done() and not second.done()
        assert scheduler.num_pending == 1
        await scheduler.resume()
        assert len((await first).token_ids) == 50 and (await second).token_ids == [7]

    run(body)


def test_close_answers_rows_taken_into_a_step_that_awaits() -> None:
    """A step that awaits (sim sleeps) when close() cancels it: its newcomers are neither
    queued nor running any more, and must still fail rather than hang."""

    async def body(scheduler: RequestScheduler, stepper: CountingStepper) -> None:
        stepper.gate = asyncio.Event()  # never set: the step is stuck until cancelled
        pending = asyncio.create_task(scheduler.submit(request(2), VOCAB, 0))
        await asyncio.wait_for(stepper.entered.wait(), 10)
        stepper.rows = []  # as sim before its prefill sleep ends: the row is only admitted
        await scheduler.close()
        with pytest.raises(RuntimeError, match="engine closed"):
            await pending
        with pytest.raises(RuntimeError, match="engine closed"):
            await scheduler.submit(request(1), VOCAB, 0)

    run(body)


def test_a_failing_step_fails_its_rows_and_the_engine_keeps_serving() -> None:
    async def body(scheduler: RequestScheduler, stepper: CountingStepper) -> None:
        stepper.fail_next = ValueError("bad step")
        with pytest.raises(ValueError, match="bad step"):
            await scheduler.submit(request(2), VOCAB, 0)
        assert stepper.rows == []
        assert (await scheduler.submit(request(2), VOCAB, 0)).token_ids == [7, 7]

    run(body)


def test_checks_zero_tokens_and_callers_that_gave_up() -> None:
    async def body(scheduler: RequestScheduler, stepper: CountingStepper) -> None:
        with pytest.raises(ValueError, match="vocabulary"):
            await scheduler.submit(GenerateRequest([VOCAB], 1.0, 1.0, 4), VOCAB, 0)
        zero = await scheduler.submit(request(0), VOCAB, 5)
        assert (zero.token_ids, zero.finish_reason, zero.version) == ([], "length", 5)
        assert stepper.admitted == []  # neither reached a step
        await scheduler.pause()
        gave_up = asyncio.create_task(scheduler.submit(request(3), VOCAB, 0))
        await asyncio.sleep(0)
        gave_up.cancel()
        kept = asyncio.create_task(scheduler.submit(request(3), VOCAB, 0))
        await asyncio.sleep(0)
        await scheduler.resume()
        assert (await kept).token_ids == [7, 7, 7]
        assert stepper.admitted[0] == 1  # the cancelled caller's request was dropped

    run(body)


def test_submit_before_start_is_refused() -> None:
    async def main() -> None:
        scheduler = RequestScheduler("test", "m", CountingStepper(1))
        with pytest.raises(RuntimeError, match=r"call start\(\) before generate"):
            await scheduler.submit(request(1), VOCAB, 0)
        await scheduler.pause()  # nothing running: returns at once
        await scheduler.close()

    asyncio.run(asyncio.wait_for(main(), 10))
