"""Backchannels and false interruptions against the real server (SmolLM2, the default turn
settings: backchannels on, resume after 1000 ms), with real audio over a playing reply: a
spoken "yeah" and a noise burst leave the reply to complete, real speech cancels it.

The "yeah" is synthetic: the shared clips hold no backchannel, so it is spoken at test time
by the repository's own Piper voice (pipeline/tts) and resampled to 16 kHz.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy.signal import butter, sosfilt

from audio.pcm import resample
from audio.wav import read_mono
from tests.spoken import spoken
from tests.test_barge_in import start_long_reply, stream_realtime
from tests.wsclient import Client

pytestmark = pytest.mark.slow  # every test here runs a real server


@pytest.fixture(scope="module")
def yeah() -> np.ndarray:
    """ "Yeah." spoken by Piper's default voice, float32 at 16 kHz."""
    return spoken("Yeah.")


def noise_burst(ms: int = 300, seed: int = 0) -> np.ndarray:
    """``ms`` of seeded white noise band-passed to 300-3400 Hz (a knock, a rustle), 16 kHz."""
    x = np.random.default_rng(seed).standard_normal(ms * 16)
    sos = butter(4, (300, 3400), btype="bandpass", fs=16000, output="sos")
    y = sosfilt(sos, x)
    return (0.4 * y / np.abs(y).max()).astype(np.float32)


def quiet(ms: int) -> np.ndarray:
    return np.zeros(ms * 16, np.float32)


async def end_of(c: Client, rid: int) -> dict:
    return await c.wait_for(lambda e: e["type"] in ("response.done", "response.cancelled") and e["response_id"] == rid)


def kinds(c: Client, rid: int) -> list[str]:
    """The types of reply ``rid``'s events, in order."""
    return [e["type"] for e in c.conv.events if e.get("response_id") == rid]


async def test_a_spoken_yeah_does_not_cancel_the_reply(server, yeah):
    async with Client(server["url"]) as c:
        rid = await start_long_reply(c)
        await stream_realtime(c, np.concatenate([yeah, quiet(1500)]))
        empty = await c.wait_for(lambda e: e["type"] == "turn.empty")
        assert empty["reason"] == "backchannel", empty
        assert any(e["type"] == "speech.started" for e in c.conv.events)
        end = await end_of(c, rid)
        assert end["type"] == "response.done", end
        seen = kinds(c, rid)
        assert "response.paused" in seen  # the reply was audible: the speech over it paused it ...
        assert seen.index("response.paused") < seen.index("response.resumed") < seen.index("response.done")
        assert not [e for e in c.conv.events if e["type"] == "response.started" and e["response_id"] != rid]


async def test_a_noise_burst_pauses_at_most_and_the_reply_completes(server):
    async with Client(server["url"]) as c:
        rid = await start_long_reply(c)
        await stream_realtime(c, np.concatenate([quiet(300), noise_burst(), quiet(1500)]))
        end = await end_of(c, rid)
        assert end["type"] == "response.done", end
        seen = kinds(c, rid)
        assert seen.count("response.paused") == seen.count("response.resumed") <= 1
        assert not [e for e in c.conv.events if e["type"] == "response.started" and e["response_id"] != rid]


async def test_real_speech_over_the_reply_cancels_it(server, audio_dir):
    x, sr = read_mono(audio_dir / "en_cmu_goforward.wav")
    async with Client(server["url"]) as c:
        rid = await start_long_reply(c)
        await stream_realtime(c, np.concatenate([resample(x, sr, 16000), quiet(1000)]))
        end = await end_of(c, rid)
        assert end["type"] == "response.cancelled" and end["reason"] == "barge_in", end
        seen = kinds(c, rid)
        assert "response.resumed" not in seen or seen.index("response.resumed") < seen.index("response.cancelled")
        nxt = await c.wait_for(lambda e: e["type"] == "response.started" and e["response_id"] > rid)
        assert "forward" in nxt["user_text"].lower(), nxt["user_text"]
        assert c.conv.audio_after_event(rid, end) == 0, "audio after response.cancelled"
