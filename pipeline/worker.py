"""A model stage's worker: one thread, one bounded queue, results as asyncio futures.

Sessions call :meth:`BatchWorker.submit` from the event loop; the worker thread takes
up to ``max_batch_size`` items that arrive within ``max_wait_ms`` of the first one and
hands them to :meth:`BatchWorker.process_batch`. The event loop never runs model code.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


BusyReason = Literal["queue", "memory", "sessions", "stage"]
"""Why work was refused: ``queue`` (the predicted time to first audio would miss the latency
SLO), ``memory`` (the LLM's memory budget is full), ``sessions`` (the server's session
cap), ``stage`` (a stage's bounded queue is full)."""


class Busy(RuntimeError):
    """Work refused for lack of capacity: the caller tells the client ``busy`` and moves on.

    Args:
        message: what was full, for people.
        reason: ``stage`` (a bounded queue is full: the default), ``memory`` (a memory
            budget), ``queue`` (the latency SLO could not be met) or ``sessions``.
        retry_after_ms: when a retry may succeed (ms).
    """

    def __init__(self, message: str, *, reason: BusyReason = "stage", retry_after_ms: int = 1000) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_ms = retry_after_ms


@dataclass(slots=True)
class _Job(Generic[In]):
    item: In
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float


class BatchWorker(Generic[In, Out]):
    """Base class of a batched stage. Subclasses implement :meth:`process_batch`.

    Args:
        name: stage name for logs, metrics and thread names.
        queue_size: bounded queue length; :meth:`submit` raises :class:`Busy` when full.
        max_batch_size: most items handed to one :meth:`process_batch` call.
        max_wait_ms: how long the first item waits for company (ms).
        workers: threads taking batches from the one queue (a pool; 1 by default).
    """

    def __init__(self, name: str, *, queue_size: int, max_batch_size: int = 1, max_wait_ms: float = 0.0,
                 workers: int = 1) -> None:
        self.name = name
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.workers = workers
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        if not self._threads:
            for i in range(self.workers):
                t = threading.Thread(target=self._run, name=f"voxpipe-{self.name}-{i}", daemon=True)
                t.start()
                self._threads.append(t)

    def stop(self) -> None:
        """Ask the workers to exit after the queued items and wait for them."""
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    @property
    def depth(self) -> int:
        """Items waiting in the queue."""
        return self._queue.qsize()

    def submit(self, item: In) -> asyncio.Future[Out]:
        """Queue ``item``; returns a future resolved with its result on this loop.

        Raises:
            Busy: the queue is full.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        try:
            self._queue.put_nowait(_Job(item, fut, loop, time.monotonic()))
        except queue.Full:
            raise Busy(f"{self.name} is busy: {self._queue.maxsize} requests already queued") from None
        return fut

    async def run(self, item: In) -> Out:
        """Submit ``item`` and await its result (cancelling the await drops the result)."""
        return await self.submit(item)

    def process_batch(self, items: list[In]) -> list[Out | BaseException]:
        """Process a batch in the worker thread; return one result or exception per item."""
        raise NotImplementedError

    def _collect(self, first: _Job) -> list[_Job]:
        jobs = [first]
        deadline = time.monotonic() + self.max_wait_ms / 1000.0
        while len(jobs) < self.max_batch_size:
            timeout = deadline - time.monotonic()
            try:
                job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._queue.put(None)
                break
            jobs.append(job)
        return jobs

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            jobs = [j for j in self._collect(first) if not j.future.cancelled()]
            if not jobs:
                continue
            try:
                results = self.process_batch([j.item for j in jobs])
            except BaseException as exc:
                logger.exception("%s batch failed", self.name)
                results = [exc] * len(jobs)
            for job, res in zip(jobs, results):
                job.loop.call_soon_threadsafe(_resolve, job.future, res)


def _resolve(fut: asyncio.Future, res: Any) -> None:
    if fut.cancelled():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
