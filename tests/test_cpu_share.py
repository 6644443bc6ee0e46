"""The LLM borrows the cores ASR and TTS leave idle (pipeline/cpu_share.py): a model step
runs with ``burst_threads`` while no batched stage computes, with ``threads`` while one
does; replies are the same either way. Tiny random Llama, no real model."""

from __future__ import annotations

import asyncio
import threading

import torch

from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.cpu_share import SHARE, CpuShare
from pipeline.llm.engine import LlmEngine
from pipeline.worker import BatchWorker
from tests.test_llm_stream import ask, reference, tiny_llm  # noqa: F401 - the fixture


def test_share_counts_nested_work_from_threads():
    share = CpuShare()
    assert not share.others_working
    with share.working():
        with share.working():
            assert share.others_working
        assert share.others_working
    assert not share.others_working


class _Recorder:
    """Wraps a runner's set_threads: which thread counts the engine asked for."""

    def __init__(self, runner) -> None:
        self.calls: list[int] = []
        self._set = runner.set_threads
        runner.set_threads = self

    def __call__(self, n: int) -> None:
        self.calls.append(n)
        self._set(n)


class _Holding(BatchWorker[str, str]):
    """A stage whose call holds until released: it 'computes' meanwhile."""

    def __init__(self) -> None:
        super().__init__("tts", queue_size=4)
        self.inside, self.release = threading.Event(), threading.Event()

    def process_batch(self, items):
        self.inside.set()
        self.release.wait(60)
        return list(items)


async def _reply(eng, text: str, n: int) -> str:
    return "".join([d async for d in eng.submit(ask(text, n))])


async def test_llm_steps_borrow_idle_cores_and_give_them_back(tiny_llm):  # noqa: F811
    threads = torch.get_num_threads()
    eng = LlmEngine(tiny_llm, LlmConfig(threads=1, burst_threads=2), SchedulerConfig(max_wait_ms=0))
    rec = _Recorder(eng.runner)
    eng.start()
    stage = _Holding()
    stage.start()
    try:
        alone = await _reply(eng, "hello there", 6)
        assert rec.calls and rec.calls[-1] == 2  # nothing else computed: two threads
        job = asyncio.ensure_future(stage.run("phrase"))
        assert await asyncio.to_thread(stage.inside.wait, 60)
        assert SHARE.others_working
        beside = await _reply(eng, "hello there", 6)
        assert rec.calls[-1] == 1  # a stage computed: back to one
        stage.release.set()
        await job
        assert not SHARE.others_working
        await _reply(eng, "again", 4)
        assert rec.calls[-1] == 2
        assert beside == alone == reference(tiny_llm, ask("hello there", 6))[0]
    finally:
        stage.release.set()
        stage.stop()
        eng.stop()
        torch.set_num_threads(threads)


async def test_no_burst_never_changes_threads(tiny_llm):  # noqa: F811
    eng = LlmEngine(tiny_llm, LlmConfig(threads=1), SchedulerConfig(max_wait_ms=0))
    rec = _Recorder(eng.runner)
    eng.start()
    try:
        await _reply(eng, "hi", 4)
    finally:
        eng.stop()
    assert rec.calls == []
