"""A stage's worker calls ``on_idle`` once per idle spell (pipeline/worker.py; the TTS stage
shrinks Piper's arena there): orchestration alone, over a scripted stage."""

from __future__ import annotations

import threading

from pipeline.worker import BatchWorker

DEADLINE_S = 30.0


class Doubler(BatchWorker[int, int]):
    def __init__(self, idle_after_s: float | None) -> None:
        super().__init__("doubler", queue_size=8)
        self.idle_after_s = idle_after_s
        self.idled = threading.Semaphore(0)
        self.calls: list[str] = []

    def process_batch(self, items: list[int]) -> list[int | BaseException]:
        self.calls.append("job")
        return [2 * i for i in items]

    def on_idle(self) -> None:
        self.calls.append("idle")
        self.idled.release()
        if len(self.calls) == 1:
            raise RuntimeError("a failing hook must not end the worker")


async def test_on_idle_runs_once_per_idle_spell_and_never_kills_the_worker():
    w = Doubler(idle_after_s=0.05)
    w.start()
    try:
        assert w.idled.acquire(timeout=DEADLINE_S)  # idle from the start: once (it raised)
        assert await w.run(3) == 6  # the worker survived its hook's error
        assert w.idled.acquire(timeout=DEADLINE_S)  # a new idle spell after the job
        assert w.calls[:3] == ["idle", "job", "idle"], w.calls
        assert await w.run(4) == 8
        assert w.idled.acquire(timeout=DEADLINE_S)
        assert w.calls.count("idle") == w.calls.count("job") + 1, w.calls  # once per spell, not per timeout
    finally:
        w.stop()


async def test_no_idle_hook_without_idle_after_s():
    w = Doubler(idle_after_s=None)
    w.start()
    try:
        assert await w.run(5) == 10
        assert not w.idled.acquire(timeout=0.3)
        assert w.calls == ["job"]
    finally:
        w.stop()
