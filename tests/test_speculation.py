"""Speculative end of turn (pipeline/speculation.py) through a real server: a pause
shorter than the end-of-turn silence starts a reply that the client never sees; a real
end of turn uses it."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import numpy as np
import pytest

from tests.test_e2e import clip16k, pcm16
from tests.wsclient import Client, wer

pytestmark = pytest.mark.slow  # every test here runs a real server

A = "en_librivox_sense_and_sensibility_01_0880.wav"  # "he was not an ill disposed young man"
B = "en_librispeech_3752-4944-0000.wav"  # "captain frere says that the scenery is delightful"


def speech_only(x: np.ndarray) -> np.ndarray:
    """The clip without its leading and trailing silence (energy threshold)."""
    loud = np.flatnonzero(np.abs(x) > 0.02)
    return x[loud[0] : loud[-1] + 1]


def speculations(server) -> dict[str, float]:
    with urllib.request.urlopen(server["http"] + "/metrics") as r:
        text = r.read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r'voxpipe_speculations_total\{outcome="(\w+)"\} ([0-9.e+]+)', text)}


async def stream_real_time(c: Client, x: np.ndarray) -> None:
    for i in range(0, len(x), 1600):  # 100 ms frames at real-time pace
        await c.ws.send(pcm16(x[i : i + 1600]))
        await asyncio.sleep(0.1)


async def test_a_short_pause_speculates_invisibly_and_gives_one_reply(server, audio_dir, manifest):
    """300 ms of silence between two sentences: longer than early_end_ms (200), shorter
    than end_silence_ms (500). The server speculates on the first sentence and drops it
    when speech resumes; the client sees one turn and one reply to both sentences."""
    a, b = speech_only(clip16k(audio_dir, A)), speech_only(clip16k(audio_dir, B))
    x = np.concatenate([np.zeros(8000, np.float32), a, np.zeros(4800, np.float32), b,
                        np.zeros(16000, np.float32)])
    before = await asyncio.to_thread(speculations, server)
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        await stream_real_time(c, x)
        done = await c.wait_for("response.done")
        kinds = [e["type"] for e in c.conv.events]
        assert "response.cancelled" not in kinds, kinds
        assert kinds.count("response.started") == 1 and kinds.count("transcript.final") == 1, kinds
        assert kinds.index("transcript.final") < kinds.index("response.started")
        ref = manifest[A]["reference_transcript"] + " " + manifest[B]["reference_transcript"]
        started = c.conv.of("response.started")[0]
        assert wer(ref, started["user_text"]) <= 0.2, started["user_text"]
        assert done["response_id"] == started["response_id"]
        assert len(c.conv.reply_audio(done["response_id"])) > 0
    after = await asyncio.to_thread(speculations, server)
    assert after.get("dropped", 0) > before.get("dropped", 0), (before, after)
    assert after.get("used", 0) > before.get("used", 0), (before, after)


async def test_held_reply_events_follow_the_final_transcript_in_order(server, audio_dir):
    """A sentence, a pause (dropped speculation), more speech, silence: the speculated
    reply's held events reach the client only after the final transcript, in order."""
    a, b = speech_only(clip16k(audio_dir, A)), speech_only(clip16k(audio_dir, B))
    x = np.concatenate([a, np.zeros(4800, np.float32), b, np.zeros(16000, np.float32)])
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        await stream_real_time(c, x)
        done = await c.wait_for("response.done")
        assert done["timings_ms"]["voice_to_voice"] > 0
        # every event of the reply came after the final transcript, in order, with audio
        order = [e["type"] for e in c.conv.events]
        i = order.index("transcript.final")
        assert order[i + 1] == "response.started", order
        assert all(t != "response.text.delta" for t in order[:i]), order


async def test_session_start_mid_utterance_ends_that_turn_explicitly(server, audio_dir):
    """A new session.start while the user speaks: the turn is closed with
    speech.stopped(restart) + turn.empty(restart), never left dangling; later speech works."""
    a = speech_only(clip16k(audio_dir, A))
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        await stream_real_time(c, a[: len(a) // 2 + 8000])
        await c.wait_for("speech.started")
        await c.start(sample_rate=16000)
        stopped = await c.wait_for(lambda e: e["type"] == "speech.stopped")
        assert stopped["reason"] == "restart"
        assert (await c.wait_for("turn.empty"))["reason"] == "restart"
        done = await c.turn(pcm16(np.concatenate([a, np.zeros(8000, np.float32)])))
        assert done["type"] == "response.done"
