"""A quiet stream's frames are handled in batches (pipeline/session/quiet_batch.py), speech
frame by frame; nothing is lost or reordered either way, and ``input.end`` flushes what
is held. The session's frame reader keeps the idle timeout without a timer per frame
(server/idle.py)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.asyncio.client import connect

from audio.pcm import RATE
from pipeline.session import events as ev
from pipeline.session.quiet_batch import QUIET_BATCH_MS, QuietBatcher
from tests.fake_server import fake_server
from tests.fakes import EnergyVadStream, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, InputEnd, Start, WaitFor
from tests.test_edge import config, until

BATCH = 2 * RATE * QUIET_BATCH_MS // 1000  # PCM16 mono 16 kHz


def test_quiet_frames_are_held_until_a_batch_and_loud_ones_pass_at_once():
    q = QuietBatcher(100)
    assert [q.take(b"a" * 30, quiet=True) for _ in range(3)] == [b"", b"", b""] and q.held == 90
    assert q.take(b"b" * 30, quiet=True) == b"a" * 90 + b"b" * 30 and q.held == 0
    assert q.take(b"c" * 150, quiet=True) == b"c" * 150  # a large frame is a batch of its own
    assert q.take(b"d" * 10, quiet=True) == b""
    assert q.take(b"e" * 5, quiet=False) == b"d" * 10 + b"e" * 5  # speech: what is held goes first
    assert q.take(b"f" * 5, quiet=False) == b"f" * 5
    assert q.drain() == b""
    with pytest.raises(ValueError):
        QuietBatcher(0)


@given(st.lists(st.tuples(st.binary(max_size=64), st.booleans()), max_size=40), st.integers(1, 200))
def test_batching_never_loses_or_reorders_bytes(frames, batch):
    q = QuietBatcher(batch)
    out = b"".join(q.take(d, quiet=quiet) for d, quiet in frames) + q.drain()
    assert out == b"".join(d for d, _ in frames)


class RecordingVad:
    """The energy VAD, recording how many samples each call got."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def stream(self):
        inner, calls = EnergyVadStream(), self.calls

        class S:
            def feed(self, samples):
                calls.append(len(samples))
                return inner.feed(samples)
        return S()


async def test_a_silent_session_feeds_the_vad_in_batches_and_speech_frame_by_frame():
    vad = RecordingVad()
    h = Harness(engines=fake_engines(vad=vad))
    frame = int(0.02 * RATE)
    await h.play([Start(), Audio(silence(2000))])
    quiet_calls = list(vad.calls)
    assert quiet_calls and min(quiet_calls) >= RATE * QUIET_BATCH_MS // 1000, quiet_calls
    assert sum(quiet_calls) == 2 * RATE - 2 * RATE % (RATE * QUIET_BATCH_MS // 1000)  # the rest is held
    vad.calls.clear()
    await h.play([Audio(tone(600)), WaitFor(ev.SpeechStarted), Audio(tone(400))])
    assert vad.calls[-10:] == [frame] * 10, vad.calls  # speech pending or on: every frame at once
    await h.play([Audio(silence(300)), InputEnd(), WaitFor(ev.SpeechStopped)])
    assert h.session.input_pos == int(3.3 * RATE)  # every sample reached the tracker, none twice
    await h.close()


async def test_input_end_flushes_held_audio_into_the_turn():
    """Speech that starts in the last, held frames is still heard when the client ends the turn."""
    h = Harness()
    seen = await h.play([Start(), Audio(np.concatenate([silence(1000), tone(60)])), InputEnd(),
                         WaitFor(ev.TurnEmpty)])
    assert h.session.input_pos == int(1.06 * RATE)
    await h.close()
    assert any(isinstance(e, ev.TurnEmpty) for e in seen)


async def test_frames_keep_a_session_open_past_the_idle_timeout_and_silence_closes_it():
    async with fake_server(config(idle_timeout_s=0.5)) as srv, connect(srv.ws) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await until(ws, lambda e: e["type"] == "session.started")
        for _ in range(20):  # 2 s of frames, 0.1 s apart: never idle
            await ws.send(bytes(640))
            await asyncio.sleep(0.1)
        await ws.send(json.dumps({"type": "text.input", "text": " "}))
        seen = await until(ws, lambda e: e["type"] == "error")
        assert seen[-1]["code"] == "bad_event", seen  # still open: the blank text is refused
        seen = await until(ws, lambda e: e["type"] == "error" and e["code"] == "idle_timeout")
        assert seen[-1]["fatal"]
