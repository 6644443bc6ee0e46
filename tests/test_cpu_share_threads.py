"""Models load in a thread of their own (pipeline/cpu_share.py): libgomp keeps an OpenMP team
for every live thread that ran a parallel region, and more managed threads than CPUs throttle
every team's spin, the LLM engine's included. These tests watch the OS threads of this process:
a team appears beside a thread that ran a parallel torch op, and is gone once that thread ended."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
import time

import pytest
import torch

from pipeline.cpu_share import in_own_thread, in_own_thread_sync


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_torch_work(n: int = 2) -> int:
    """A parallel region in torch's OpenMP runtime (a reduction well above its grain size)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        torch.ones(1 << 23).sum()
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def _settles(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _steady_threads() -> int:
    """The thread count once exiting threads are gone: two readings 0.2 s apart agree."""
    last = _os_threads()
    for _ in range(100):
        time.sleep(0.2)
        now, last = last, _os_threads()
        if now == last:
            break
    return last


def test_a_living_thread_keeps_its_openmp_team_and_an_own_thread_does_not():
    first = threading.Thread(target=_parallel_torch_work)  # the runtime's own first-use thread, once
    first.start()
    first.join()
    base = _steady_threads()
    # the control: a thread that ran the parallel op and stays alive keeps a worker beside it
    release = threading.Event()
    stays = threading.Thread(target=lambda: (_parallel_torch_work(), release.wait()))
    stays.start()
    try:
        assert _settles(lambda: _os_threads() >= base + 2), "no OpenMP worker beside the living thread"
    finally:
        release.set()
        stays.join()
    assert _settles(lambda: _os_threads() <= base)  # its team ended with it
    assert in_own_thread_sync(_parallel_torch_work) == 2
    assert _settles(lambda: _os_threads() <= base)


def test_results_and_errors_come_back_from_the_own_thread():
    assert in_own_thread_sync(divmod, 7, 2) == (3, 1)
    assert in_own_thread_sync(int, "ff", base=16) == 255
    with pytest.raises(ZeroDivisionError):
        in_own_thread_sync(divmod, 1, 0)

    async def main():
        assert await in_own_thread(int, "ff", base=16) == 255
        names = await in_own_thread(lambda: threading.current_thread().name)
        assert names.startswith("voxpipe-load") and names != threading.current_thread().name
        with pytest.raises(ZeroDivisionError):
            await in_own_thread(divmod, 1, 0)

    asyncio.run(main())


def test_stop_iteration_and_context_variables_cross_the_thread():
    def stops():
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):
        in_own_thread_sync(stops)
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    var.set("the caller's")
    assert in_own_thread_sync(var.get) == "the caller's"

    async def main():
        with pytest.raises(RuntimeError, match="StopIteration"):  # before: the await never returned
            await asyncio.wait_for(in_own_thread(stops), 30)
        assert await in_own_thread(var.get) == "the caller's"

    asyncio.run(main())
