"""One retriever call per wave of concurrent searches.

An actor runs the G episodes of several groups as coroutines on one asyncio loop; in a
turn their Search Agents emit queries at nearly the same moment. Each `search(query)`
queues its query; a single drain task, started on the first call, takes everything queued
(up to max_batch) once the loop has run the other ready coroutines, runs ONE
`retriever.search(batch, top_k)` in a worker thread (the loop keeps generating), and hands
each caller its own list. Queries that arrive while a batch runs form the next batch, so
the retriever is never called from two threads at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from drmas.retrieval import Retriever
from drmas.retrieval.corpus import Passage

log = logging.getLogger("drmas.retrieval")


class BatchingRetriever:
    def __init__(self, retriever: Retriever, top_k: int, max_batch: int, timeout_s: float) -> None:
        if max_batch < 1:
            raise ValueError(f"retriever.max_batch must be >= 1, got {max_batch}")
        self.retriever = retriever
        self.top_k = top_k
        self.max_batch = max_batch
        self.timeout_s = timeout_s
        self.calls = 0
        """search() calls so far."""
        self.batches = 0
        """retriever.search() calls so far."""
        self.queries = 0
        """Queries sent to the retriever so far (the sum of the batch sizes)."""
        self._queue: list[tuple[str, asyncio.Future[list[Passage]]]] = []
        self._drain: asyncio.Task[None] | None = None

    async def search(self, query: str) -> list[Passage]:
        """The top_k passages for `query`, best first. RuntimeError if the retriever failed
        on this query's batch; TimeoutError after timeout_s (queueing included)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Passage]] = loop.create_future()
        self._queue.append((query, future))
        self.calls += 1
        if self._drain is None or self._drain.done() or self._drain.get_loop() is not loop:
            self._drain = loop.create_task(self._run(), name="retrieval-batches")
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.retriever!r} did not answer within retriever.timeout_s="
                f"{self.timeout_s} s (the batch holding {query[:60]!r})"
            ) from None

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let this tick's other searches queue up
        while self._queue:
            batch = self._queue[: self.max_batch]
            del self._queue[: self.max_batch]
            batch = [(q, f) for q, f in batch if not f.done()]  # timed-out callers left
            if not batch:
                continue
            queries = [q for q, _ in batch]
            self.batches += 1
            self.queries += len(queries)
            try:
                results = await asyncio.to_thread(self.retriever.search, queries, self.top_k)
                if len(results) != len(queries):
                    raise ValueError(f"{len(results)} result lists for {len(queries)} queries")
            except Exception as exc:
                message = f"{self.retriever!r} failed on a batch of {len(queries)} queries: {exc}"
                for _, future in batch:
                    if not future.done():
                        error = RuntimeError(message)
                        error.__cause__ = exc
                        future.set_exception(error)
                continue
            for (_, future), hits in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(hits)

    def close(self) -> None:
        """Fail queued searches, stop the drain task, close the retriever."""
        for _, future in self._queue:
            if not future.done():
                future.set_exception(RuntimeError(f"{self.retriever!r} was closed"))
        self._queue.clear()
        if self._drain is not None and not self._drain.done():
            with contextlib.suppress(RuntimeError):  # its loop may be closed already
                self._drain.cancel()
        self.retriever.close()
