"""Barge-in against the real server: talking over a reply cancels it; noise does not."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from audio.pcm import resample
from audio.wav import read_mono
from tests.wsclient import Client, wer

pytestmark = pytest.mark.slow  # every test here runs a real server

LONG = "Tell me a long story about a dragon who learns to bake bread."
CLIP = "en_librispeech_1988-24833-0003.wav"


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def stream_realtime(c: Client, x: np.ndarray, frame: int = 1600) -> None:
    for i in range(0, len(x), frame):
        await c.ws.send(pcm16(x[i : i + frame]))
        await asyncio.sleep(frame / 16000)


async def start_long_reply(c: Client) -> int:
    await c.start(sample_rate=16000, output_sample_rate=16000)
    await c.ws.send(pcm16(np.zeros(16000, np.float32)))  # some room tone first
    await c.send_json({"type": "text.input", "text": LONG})
    started = await c.wait_for("response.started")
    rid = started["response_id"]
    await c.wait_until(lambda: c.conv.audio.get(rid), what="the reply's first audio")  # the assistant is speaking
    return rid


async def test_speech_over_the_reply_cancels_it_and_the_next_reply_answers(server, audio_dir, manifest):
    x, sr = read_mono(audio_dir / CLIP)
    speech = resample(x, sr, 16000)
    async with Client(server["url"]) as c:
        rid = await start_long_reply(c)
        await stream_realtime(c, speech)
        # cancelled while the user was still talking (confirmed by ASR words), not at the
        # end of the turn: the reason says so (a barge-in is only possible while the user
        # speaks), and the cancel comes before the speech.stopped that ends the user's turn
        await stream_realtime(c, np.zeros(16000, np.float32))
        cancelled = await c.wait_for(lambda e: e["type"] == "response.cancelled" and e["response_id"] == rid)
        assert cancelled["reason"] == "barge_in"
        i = c.conv.events.index(cancelled)
        assert any(e["type"] == "speech.started" for e in c.conv.events[:i]), "cancelled before the user spoke"
        await c.wait_for(lambda e: e["type"] == "speech.stopped" and c.conv.events.index(e) > i)
        nxt = await c.wait_for(lambda e: e["type"] == "response.started" and e["response_id"] > rid)
        assert wer(manifest[CLIP]["reference_transcript"], nxt["user_text"]) <= 0.25, nxt["user_text"]
        await c.wait_for(lambda e: e["type"] == "response.done" and e["response_id"] == nxt["response_id"])
        assert c.conv.audio_after_event(rid, cancelled) == 0, "stale audio after response.cancelled"
        assert not any(e["type"] == "response.done" and e["response_id"] == rid for e in c.conv.events)
        # the history keeps only what was spoken of the cancelled reply
        assert cancelled["spoken_text"] and len(cancelled["spoken_text"]) < 2000


async def test_noise_burst_does_not_cancel_the_reply(server):
    rng = np.random.default_rng(0)
    burst = np.concatenate([np.zeros(8000, np.float32), (rng.standard_normal(3200) * 0.5).astype(np.float32),
                            np.zeros(16000, np.float32)])  # 200 ms of loud white noise
    async with Client(server["url"]) as c:
        rid = await start_long_reply(c)
        await stream_realtime(c, burst)
        done = await c.wait_for(lambda e: e["type"] in ("response.done", "response.cancelled")
                                and e["response_id"] == rid)
        assert done["type"] == "response.done"
