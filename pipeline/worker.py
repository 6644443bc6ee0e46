"""A model stage's worker: one thread, one bounded queue, results as asyncio futures.

Sessions call :meth:`BatchWorker.submit` from the event loop; the worker thread takes
up to ``max_batch_size`` items that arrive within ``max_wait_ms`` of the first one and
hands them to :meth:`BatchWorker.process_batch`. The event loop never runs model code.

Items have a priority (:meth:`BatchWorker.priority`, 0 = most urgent): the queue hands
out the most urgent first (FIFO within a priority), and a batch that starts with an
urgent item takes only items as urgent, so latency-critical work (a turn's final
transcript) never waits behind, nor is slowed by, best-effort work (partial transcripts).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pipeline.cpu_share import SHARE
from pipeline.errors import Busy
from pipeline.serving.faults import NO_FAULTS, FaultInjector, injected
from pipeline.serving.ladder import free_cached_memory, is_oom
from pipeline.serving.types import StageLoad

if TYPE_CHECKING:
    from pipeline.serving.ladder import OomLadder

logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


def name_native_thread() -> None:
    """Give the calling thread's OS-level name its Python name (first 15 bytes, Linux
    ``prctl(PR_SET_NAME)``), so ``top -H``, ``ps -L`` and profilers show the stage that
    burns the CPU. A no-op where that is unavailable."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, threading.current_thread().name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


@dataclass(slots=True, order=True)
class _Job(Generic[In]):
    priority: int
    seq: int
    item: In = field(compare=False)
    future: asyncio.Future | None = field(compare=False)  # None: the stop sentinel
    loop: asyncio.AbstractEventLoop | None = field(compare=False)
    enqueued: float = field(compare=False)


_STOP_PRIORITY = 1 << 30  # after every queued item
MAX_OOM_RETRIES = 3
"""A batch that runs out of memory is retried this many times, climbing the stage's
out-of-memory ladder each time (:mod:`pipeline.serving.ladder`); then its requests fail."""


class CallGuard(Protocol):
    """A stage's circuit breaker as its worker sees it (:class:`pipeline.serving.governor.StageGuard`)."""

    def permit(self) -> bool:
        """Whether a call may go ahead now."""
        ...

    def record(self, duration_s: float, failed: bool) -> None:
        """A call's outcome: its service time (s) and whether it failed."""
        ...


class BatchWorker(Generic[In, Out]):
    """Base class of a batched stage. Subclasses implement :meth:`process_batch`.

    Args:
        name: stage name for logs, metrics and thread names.
        queue_size: bounded queue length; :meth:`submit` raises :class:`~pipeline.errors.Busy` when full.
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
        self.queue_size = queue_size
        # unbounded underneath (the worker puts back what may not join a batch, which must
        # never block); :meth:`submit` keeps the bound
        self._queue: queue.PriorityQueue[_Job] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads: list[threading.Thread] = []
        self.faults: FaultInjector = NO_FAULTS  # injected faults (tests, drills)
        self.ladder: OomLadder | None = None  # the out-of-memory ladder (None: an OOM fails the batch)
        self.guard: CallGuard | None = None  # the circuit breaker (None: every call goes ahead)

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
            self._queue.put(self._stop_job())
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    def _stop_job(self) -> _Job:
        return _Job(_STOP_PRIORITY, next(self._seq), None, None, None, 0.0)

    def priority(self, item: In) -> int:
        """How urgent ``item`` is: 0 (most) and up. Subclasses override; all 0 here."""
        return 0

    def batch_limit(self, priority: int) -> int:
        """Most items in a batch led by an item of ``priority`` (``max_batch_size`` here).
        A smaller limit for best-effort work bounds how long urgent work that arrives
        meanwhile waits for the batch in progress."""
        return self.max_batch_size

    @property
    def depth(self) -> int:
        """Items waiting in the queue."""
        return self._queue.qsize()

    @property
    def urgent_depth(self) -> int:
        """Items waiting at priority 0 (what an urgent item queues behind); an item whose
        caller stopped waiting (its future cancelled: the turn went on) is skipped by the
        worker and not counted. Call on the event loop's thread (it reads the futures)."""
        with self._queue.mutex:  # the heap is read under the queue's own lock
            return sum(1 for job in self._queue.queue
                       if job.priority == 0 and job.future is not None and not job.future.cancelled())

    def load(self) -> StageLoad:
        """The stage's load: :attr:`depth` and :attr:`urgent_depth` (no batch slots or KV
        cache here: those fields are 0). Call on the event loop's thread, as :attr:`urgent_depth`."""
        return StageLoad(depth=self.depth, urgent_depth=self.urgent_depth)

    def submit(self, item: In, *, priority: int | None = None) -> asyncio.Future[Out]:
        """Queue ``item`` (``priority``: 0 = most urgent; None: :meth:`priority` decides);
        returns a future resolved with its result on this loop.

        Raises:
            Busy: the queue is full (reason ``stage``), or the stage's circuit breaker is
                open (reason ``breaker``).
        """
        if self._queue.qsize() >= self.queue_size:
            raise Busy(f"{self.name} is busy: {self.queue_size} requests already queued")
        if self.guard is not None and not self.guard.permit():
            raise Busy(f"{self.name} is unavailable: its circuit breaker is open", reason="breaker",
                       retry_after_ms=2000)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        rank = self.priority(item) if priority is None else priority
        self._queue.put_nowait(_Job(rank, next(self._seq), item, fut, loop, time.monotonic()))
        return fut

    async def run(self, item: In, *, priority: int | None = None) -> Out:
        """Submit ``item`` and await its result (cancelling the await drops the result)."""
        return await self.submit(item, priority=priority)

    def process_batch(self, items: list[In]) -> list[Out | BaseException]:
        """Process a batch in the worker thread; return one result or exception per item."""
        raise NotImplementedError

    def _collect(self, first: _Job) -> list[_Job]:
        """``first`` and what joins it within ``max_wait_ms``: items at most as urgent as
        ``first`` may not join an urgent batch (they are put back)."""
        jobs = [first]
        deadline = time.monotonic() + self.max_wait_ms / 1000.0
        limit = self.batch_limit(first.priority)
        if self.ladder is not None:  # halved from the ladder's step 2 on
            limit = min(limit, self.ladder.batch_size(self.max_batch_size))
        while len(jobs) < limit:
            timeout = deadline - time.monotonic()
            try:
                job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if job.future is None or job.priority > first.priority:
                self._queue.put(job)  # the stop sentinel, or less urgent work: it waits its turn
                break
            jobs.append(job)
        return jobs

    idle_after_s: float | None = None
    """A worker that has had no job for this long calls :meth:`on_idle` once (None: never)."""

    def on_idle(self) -> None:
        """Called in a worker thread once it has waited :attr:`idle_after_s` for a job (once
        per idle spell): release what the stage keeps between jobs. Nothing by default."""

    def _run(self) -> None:
        name_native_thread()
        idle = False
        while True:
            try:
                wait = None if idle or self.idle_after_s is None else self.idle_after_s
                first = self._queue.get(timeout=wait)
            except queue.Empty:
                idle = True
                try:
                    self.on_idle()
                except Exception:
                    logger.exception("%s: on_idle failed", self.name)
                continue
            idle = False
            if first.future is None:
                return
            jobs = [j for j in self._collect(first) if j.future is not None and not j.future.cancelled()]
            if not jobs:
                continue
            jobs, results = self._call(jobs)
            for job, res in zip(jobs, results):
                assert job.loop is not None and job.future is not None
                job.loop.call_soon_threadsafe(_resolve, job.future, res)

    def _call(self, jobs: list[_Job]) -> tuple[list[_Job], list[Any]]:
        """Run :meth:`process_batch` on ``jobs`` through the fault injector and the
        out-of-memory ladder; returns the jobs that ran and their results (the others were
        requeued). Each job's outcome (the batch's time, failed or not) goes to the guard."""
        for attempt in range(MAX_OOM_RETRIES + 1):
            t0 = time.perf_counter()
            try:
                self.faults.hit(self.name)
                with SHARE.working():  # the LLM does not borrow our core meanwhile (pipeline.cpu_share)
                    results = self.process_batch([j.item for j in jobs])
            except BaseException as exc:
                if self.ladder is None or not is_oom(exc) or attempt == MAX_OOM_RETRIES:
                    logger.error("%s batch failed: %s", self.name, exc, exc_info=not (is_oom(exc) or injected(exc)))
                    self._outcomes(len(jobs), time.perf_counter() - t0, [exc])
                    return jobs, [exc] * len(jobs)
                self.ladder.oom(time.monotonic())
                self.free_memory()
                limit = self.ladder.batch_size(self.max_batch_size)
                for job in jobs[limit:]:  # the newest go back to the queue, in order
                    self._queue.put(job)
                jobs = jobs[:limit]
                continue
            self._outcomes(len(jobs), time.perf_counter() - t0, results)
            return jobs, results
        raise AssertionError("unreachable")

    def _outcomes(self, n: int, seconds: float, results: list[Any]) -> None:
        if self.guard is None:
            return
        failed = [isinstance(r, BaseException) and not isinstance(r, Busy) for r in results]
        for i in range(n):
            self.guard.record(seconds, failed[i] if len(failed) == n else failed[0])

    def free_memory(self) -> None:
        """The ladder's step 1: free what the stage caches (:func:`free_cached_memory`)."""
        free_cached_memory()


def _resolve(fut: asyncio.Future, res: Any) -> None:
    if fut.cancelled():
        return
    if isinstance(res, BaseException):
        fut.set_exception(res)
    else:
        fut.set_result(res)
