"""Back-to-back sessions leave nothing behind (issue 37): 20 sessions of four kinds (turns
answered, a reply or speech cut by the client's leaving, the Realtime API) through the real
server on loopback over fake stages, then over the real LLM engine with a tiny random
model. Afterwards no object of a voxpipe class is left over from them, and the state kept
across sessions, keyed by session, turn or request (admission's turns, the governor's
listeners, the LLM engine's requests, batch rows and prefix-cache blocks), is empty.

Objects are counted by class with ``gc.get_objects()`` after a full collection, against a
baseline taken after one session of each kind (what is made once per process is made then):
a weak reference per class would need a hook in every constructor, and would miss the class
nobody thought of."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
from collections import Counter

import numpy as np
from websockets.asyncio.client import connect

from audio.pcm import RATE, resample
from pipeline.config import LlmConfig, SchedulerConfig, VoxpipeConfig
from pipeline.engines import Engines
from pipeline.llm.engine import LlmEngine
from pipeline.serving.admission import Admission
from pipeline.serving_config import DegradeConfig
from server.realtime.types import REALTIME_RATE
from tests.fake_server import Running, fake_server
from tests.fakes import FakeAsr, FakeLlm, FakeTts, LlmReply, fake_engines, pcm16, silence, tone
from tests.test_edge import until
from tests.test_llm_memory import tiny

SESSIONS = 20
OWN_MODULES = ("pipeline.", "server.", "audio.")


class QuietLlm(FakeLlm):
    """The fake LLM without its records (they would keep every request alive)."""

    def submit(self, req):
        stream = super().submit(req)
        self.requests.clear()
        self.streams.clear()
        return stream


class QuietAsr(FakeAsr):
    async def run(self, item):
        out = await super().run(item)
        self.requests.clear()
        return out


class QuietTts(FakeTts):
    async def run(self, item, *, priority=None):
        out = await super().run(item, priority=priority)
        self.phrases.clear()
        return out


def own_objects() -> Counter[str]:
    """Live objects of voxpipe's own classes, by qualified class name, after a full collection."""
    gc.collect()
    out: Counter[str] = Counter()
    for o in gc.get_objects():
        module = type(o).__dict__.get("__module__")  # (a class's __module__ attribute may be a descriptor)
        if isinstance(module, str) and module.startswith(OWN_MODULES):
            out[f"{module}.{type(o).__qualname__}"] += 1
    return out


async def conversation(srv: Running, i: int) -> None:
    """One session of four kinds, by ``i``: a spoken and a typed turn answered to their
    end; a reply cut by the client's leaving; speech cut by the client's leaving; a spoken
    turn answered over the Realtime API. Then the client closes."""
    if i % 4 == 3:
        await realtime_conversation(srv)
        return
    async with connect(srv.ws) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await until(ws, lambda e: e["type"] == "session.started")
        await ws.send(pcm16(tone(600)) + pcm16(silence(100)))
        if i % 4 == 2:
            await until(ws, lambda e: e["type"] == "speech.started")
            return  # gone mid-speech
        await ws.send(json.dumps({"type": "input.end"}))
        if i % 4 == 1:
            await until(ws, lambda e: e["type"] == "response.text.delta")
            return  # gone mid-reply
        await until(ws, lambda e: e["type"] == "response.done")
        await ws.send(json.dumps({"type": "text.input", "text": "and now?"}))
        await until(ws, lambda e: e["type"] == "response.done")


async def realtime_conversation(srv: Running) -> None:
    """A spoken turn over the Realtime API (server VAD ends it), answered to its end."""
    async with connect(f"ws://127.0.0.1:{srv.port}/v1/realtime") as ws:
        await until(ws, lambda e: e["type"] == "session.created")
        audio = np.concatenate([tone(600), silence(800)])
        pcm = pcm16(resample(audio, RATE, REALTIME_RATE))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
        await until(ws, lambda e: e["type"] == "response.done")


async def settled(srv: Running) -> None:
    """Until the server has closed every session (its handler runs on after the client's close)."""
    await eventually(lambda: srv.app.sessions == 0)
    for _ in range(5):  # tasks cancelled on close run their last steps
        await asyncio.sleep(0)


async def test_back_to_back_sessions_leave_no_object_or_state_behind():
    reply = LlmReply.of("One.", " Two.", " Three.", " Four.", delay_s=0.02)
    await leaves_nothing(fake_engines(asr=QuietAsr(), llm=QuietLlm(default=reply), tts=QuietTts()))


async def test_the_llm_engine_keeps_nothing_of_ended_sessions():
    llm = LlmEngine(tiny(), LlmConfig(max_new_tokens=24), SchedulerConfig(max_wait_ms=0))
    engines = fake_engines(asr=QuietAsr(), llm=llm, tts=QuietTts())  # type: ignore[arg-type]
    llm.start()
    try:
        await leaves_nothing(engines)
        await eventually(lambda: llm.load().active == 0 and not llm.output.live)
        blocks = llm.runner.blocks
        assert blocks is not None and blocks.stats.queried_tokens > 0  # the cache was used
        await eventually(lambda: len(blocks) == 0)  # every block had an owner, and they all ended
        assert llm.scheduler.requests == {} and not llm.scheduler.waiting
        assert llm.runner._held == {} and llm.runner._partial == {} and llm.runner.batch is None
    finally:
        llm.stop()


async def eventually(cond, timeout_s: float = 60.0) -> None:
    """Wait until ``cond()`` holds (the engine thread's housekeeping); fail after a deadline
    far beyond any machine's speed."""
    for _ in range(int(timeout_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def left_over(before: Counter[str], timeout_s: float = 30.0) -> dict[str, int]:
    """The classes with more live objects than ``before``, and how many more, once that is
    nothing or ``timeout_s`` passed (a loaded machine may still be running the last
    sessions' cancelled tasks: what is left over for good stays, what is late goes)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        after = own_objects()
        grown = {name: after[name] - before[name] for name in after if after[name] > before[name]}
        if not grown or loop.time() > deadline:
            return grown
        await asyncio.sleep(0.25)


async def leaves_nothing(engines: Engines) -> None:
    """Serve :data:`SESSIONS` conversations over ``engines``; assert none left anything behind."""
    # no SLO adaptation: a slow machine's replies would make the server degrade (a Condition
    # kept while in force), which is process-wide state, not a session's
    async with fake_server(VoxpipeConfig(degrade=DegradeConfig(adapt=False)), engines=engines) as srv:
        for i in range(4):  # first use: anything made once per process is made now
            await conversation(srv, i)
        await settled(srv)
        before = own_objects()
        for i in range(SESSIONS):
            await conversation(srv, i)
        await settled(srv)
        grown = await left_over(before)
        assert grown == {}, f"left over from {SESSIONS} sessions: {grown}"
        admission = srv.app.admission
        assert isinstance(admission, Admission)
        assert (admission._pending, admission._critical, admission._predicted) == ({}, {}, {})
        assert srv.app.governor._listeners == []
        assert srv.app.sessions == 0
