"""Speaking back: cancel/restart, pacing, empty replies."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from tests.wsclient import Client, normalize

LONG = "Tell me a long story about a dragon who learns to bake bread."


@pytest.mark.slow
async def test_ten_cancel_restart_cycles_then_a_normal_turn(server):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        frames_at_cancel: dict[int, int] = {}
        for i in range(10):
            n = len(c.conv.events)
            await c.send_json({"type": "text.input", "text": f"{LONG} Version {i}."})
            started = await c.wait_for(lambda e, n=n: e["type"] == "response.started" and c.conv.events.index(e) >= n)
            rid = started["response_id"]
            if i % 2:  # half the time, cancel right away (stop -> start -> stop within 100 ms)
                await asyncio.sleep(0.05)
            else:
                await c.wait_for(lambda e, rid=rid: e["type"] == "response.text.delta" and e["response_id"] == rid)
            await c.send_json({"type": "response.cancel"})
            ev = await c.wait_for(lambda e, rid=rid: e["type"] in ("response.cancelled", "response.done")
                                  and e.get("response_id") == rid)
            assert ev["type"] == "response.cancelled"
            frames_at_cancel[rid] = len(c.conv.audio.get(rid, []))
        n = len(c.conv.events)
        await c.send_json({"type": "text.input", "text": "What is the capital of France?"})
        done = await c.wait_for(lambda e: e["type"] == "response.done" and c.conv.events.index(e) >= n)
        assert "paris" in done["text"].lower()
        assert len(c.conv.reply_audio(done["response_id"])) / 16000 >= 0.5
        await asyncio.sleep(0.3)
        for rid, frames in frames_at_cancel.items():  # nothing of a cancelled reply after its cancel
            assert len(c.conv.audio.get(rid, [])) == frames
        assert not c.conv.of("error")


@pytest.mark.slow
async def test_reply_audio_is_paced_near_real_time(server):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        await c.send_json({"type": "text.input", "text": LONG})
        started = await c.wait_for("response.started")
        rid = started["response_id"]
        await c.wait_until(lambda: c.conv.audio.get(rid), what="the reply's first audio")
        t_first = time.perf_counter()
        done = await c.wait_for("response.done")
        elapsed = time.perf_counter() - t_first
        # audio beyond the 1 s lead cannot arrive faster than it plays (a lower bound on
        # the time taken: a slow machine only takes longer)
        assert done["audio_s"] > 3.0
        assert elapsed >= done["audio_s"] - 1.0 - 0.3


class _FakeStream:
    """An LLM stream that ends at once, like a model emitting EOS first."""

    def __init__(self, deltas):
        self._deltas = list(deltas)
        self.stats = type("S", (), {"ttft_ms": 1.0, "tpot_ms": 0.0, "finish_reason": "stop", "output_tokens": 0})()

    def abort(self):
        pass

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._deltas:
            raise StopAsyncIteration
        return self._deltas.pop(0)


@pytest.mark.slow  # the real Piper voice
@pytest.mark.parametrize("deltas", [[], [""], ["   ", "\n"], [" ", "…", "?!"]])
async def test_empty_or_unspeakable_reply_speaks_a_fallback(deltas):
    """Response logic only (a scripted LLM stream; real TTS)."""
    from pipeline.config import TtsConfig, VoxpipeConfig
    from pipeline.session.history import ChatHistory
    from pipeline.session.responder import EMPTY_REPLY, Responder
    from pipeline.tts.engine import TtsEngine
    from pipeline.tts.loader import load_voice

    class Out:
        def __init__(self):
            self.events, self.frames = [], []

        async def send(self, event):  # a typed server event (pipeline/session/events.py)
            self.events.append(event.model_dump())

        async def event(self, kind, **f):  # the older keyword form
            self.events.append({"type": kind, **f})

        async def audio(self, rid, pcm):
            self.frames.append(pcm)

    class Engines:
        llm = type("L", (), {"submit": lambda self, req: _FakeStream(deltas), "count_tokens": lambda self, m: 10})()
        tts = TtsEngine(load_voice(TtsConfig()), TtsConfig())
        fallback_llm = None

    Engines.tts.start()
    out, hist = Out(), ChatHistory("sys")
    errors = []

    async def error(code, msg):
        errors.append(code)

    r = Responder(rid=1, engines=Engines, cfg=VoxpipeConfig(), out=out, history=hist, output_rate=16000, error=error)
    await r.run("hello", t_end=time.perf_counter(), asr_ms=0)
    Engines.tts.stop()
    done = out.events[-1]
    assert done["type"] == "response.done" and done["fallback"] and done["text"] == EMPTY_REPLY
    assert out.frames and not errors
    assert hist.turns == [("hello", EMPTY_REPLY)]


@pytest.mark.slow
async def test_cancel_as_the_first_audio_arrives_never_freezes_the_session(server):
    """Regression: a cancel racing the first audio frame was swallowed, freezing the session."""
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        for i in range(6):
            n = len(c.conv.events)
            await c.send_json({"type": "text.input", "text": f"{LONG} Part {i}."})
            started = await c.wait_for(lambda e, n=n: e["type"] == "response.started" and c.conv.events.index(e) >= n)
            rid = started["response_id"]
            await c.wait_until(lambda rid=rid: c.conv.audio.get(rid), what="the reply's first audio")
            await c.send_json({"type": "response.cancel"})
            # a frozen session never answers: the deadline catches that, however slow the machine
            ev = await c.wait_for(lambda e, rid=rid: e["type"] in ("response.cancelled", "response.done")
                                  and e.get("response_id") == rid)
            assert ev["type"] == "response.cancelled"
        await c.send_json({"type": "text.input", "text": "Say hi."})
        assert (await c.wait_for(lambda e: e["type"] == "response.done"))["text"]


@pytest.mark.slow
async def test_push_to_talk_turns_do_not_merge(server, audio_dir):
    """With no audio between turns, the sample gap is zero; the second turn must still be its own."""
    from audio.pcm import resample
    from audio.wav import read_mono

    def pcm(name):
        x, sr = read_mono(audio_dir / name)
        return (np.clip(resample(x, sr, 16000), -1, 1) * 32767).astype("<i2").tobytes()

    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, vad=False)
        assert (await c.turn(pcm("en_cmu_goforward.wav")))["type"] == "response.done"
        await asyncio.sleep(2.5)
        n = len(c.conv.events)
        await c.send_audio(pcm("en_librispeech_3752-4944-0000.wav"))
        await c.send_json({"type": "input.end"})
        final = await c.wait_for(lambda e: e["type"] == "transcript.final" and c.conv.events.index(e) >= n)
        text = normalize(final["text"])
        assert "scenery" in text and "forward" not in text
