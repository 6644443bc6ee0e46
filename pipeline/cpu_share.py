"""Which CPU-bound stages are computing now, so the LLM can borrow the cores they leave idle.

ASR (CTranslate2) and TTS (onnxruntime, or torch for a Coqui voice) keep thread pools of a
fixed size (one thread each by default); torch's intra-op threads are the LLM's. On a small
CPU the LLM's budget is one thread, so that a reply decodes beside a partial transcript or
a phrase being synthesized without the three fighting for two cores. Most of a turn,
though, only the LLM computes — the prompt's prefill right after the final transcript, and
decode between two phrases — and then a second core sits idle. Each batched stage marks its
work here (:meth:`CpuShare.working`, in :class:`pipeline.worker.BatchWorker`); the LLM
engine reads :attr:`CpuShare.others_working` before each model step and runs it with its
burst thread count when nothing else computes (``LlmConfig.burst_threads``).

Switching costs one ``torch.set_num_threads`` call (an OpenMP team-size change between
parallel regions: microseconds); with ``OMP_WAIT_POLICY=PASSIVE`` an idle OpenMP thread
sleeps instead of spinning (after :data:`OMP_SPIN_COUNT`), so the borrowed core is really
given back.

That spin holds only while libgomp (torch's OpenMP runtime) manages no more threads than
there are CPUs: beyond, every worker spins ~100 times and sleeps (its "throttled" spin,
libgomp's ``env.c``), and each of a decode step's parallel kernels wakes the LLM's second
thread through a futex again. libgomp keeps a team of workers for every thread that ran a
parallel region, as long as that thread lives; so models load in a thread of their own
(:func:`in_own_thread`), whose team ends with it, not in the main thread or an executor's.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")

OMP_SPIN_COUNT = 10000
"""libgomp's spins before an idle OpenMP worker sleeps (``GOMP_SPINCOUNT``; libgomp counts
~100,000 spins per ms, so ~0.1 ms). With ``OMP_WAIT_POLICY=PASSIVE`` alone it is 0: every
one of a decode step's ~170 parallel kernels then wakes the LLM's second thread through a
futex, and two threads decoded *slower* than one; with this spin two threads are faster
(docs/BENCHMARKS.md). An idle server still spins for nothing: a worker sleeps 0.1 ms after
its last kernel."""


class CpuShare:
    """A thread-safe count of stage calls in progress."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._working = 0

    @contextmanager
    def working(self) -> Iterator[None]:
        """Mark the body as a stage computing (any thread; nests)."""
        with self._lock:
            self._working += 1
        try:
            yield
        finally:
            with self._lock:
                self._working -= 1

    @property
    def others_working(self) -> bool:
        """Whether any marked stage call is in progress now (a racy read is fine: it only
        picks the next LLM step's thread count)."""
        return self._working > 0


SHARE = CpuShare()
"""The process's one instance."""

MAX_AUTO_BURST = 4
"""``voxpipe serve``'s default burst is the CPUs this process may use, at most this many: a
0.5 B model's per-layer matrices are small, and more threads mostly add synchronisation
(measured only up to 2 threads: docs/BENCHMARKS.md)."""


def auto_burst_threads() -> int:
    """What ``LlmConfig.burst_threads`` None (auto) becomes where every stage runs in this process
    (:func:`pipeline.engines.load_engines`): the CPUs this process may run on (its affinity
    mask), at most :data:`MAX_AUTO_BURST`."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return min(n, MAX_AUTO_BURST)


def _call(fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    try:
        return fn(*args, **kwargs)
    except StopIteration as exc:  # a Future cannot carry it: the awaiting task would wait forever
        raise RuntimeError(f"{getattr(fn, '__name__', fn)!s} raised StopIteration") from exc


def in_own_thread_sync(fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` run in a new thread that ends when it returns (see the module
    docstring: the OpenMP team a loader's torch ops start ends with it), in a copy of the
    caller's context variables. torch's per-thread modes (``no_grad``, ``inference_mode``)
    are the new thread's defaults, not the caller's.

    Raises:
        whatever ``fn`` raises; a ``StopIteration`` as a ``RuntimeError`` (a future cannot carry it).
    """
    with ThreadPoolExecutor(1, thread_name_prefix="voxpipe-load") as pool:
        return pool.submit(contextvars.copy_context().run, _call, fn, args, kwargs).result()


async def in_own_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """:func:`in_own_thread_sync` for the event loop: awaits ``fn(*args, **kwargs)`` without blocking
    it (if the awaiting task is cancelled, ``fn`` still runs to its end, then its thread ends).

    Raises:
        whatever ``fn`` raises; a ``StopIteration`` as a ``RuntimeError``.
    """
    pool = ThreadPoolExecutor(1, thread_name_prefix="voxpipe-load")
    try:
        call = functools.partial(contextvars.copy_context().run, _call, fn, args, kwargs)
        return await asyncio.get_running_loop().run_in_executor(pool, call)
    finally:
        pool.shutdown(wait=False)  # the thread exits after its one call
