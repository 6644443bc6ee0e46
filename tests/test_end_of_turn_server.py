"""The semantic end of turn through a real server (``--end-of-turn smart-turn``, the real
Smart Turn v3.2 model) with real speech: a finished sentence ends the turn on the model's
word, a thinking pause mid-sentence does not end it — where the silence rule cuts it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import running_server
from tests.test_e2e import clip16k, pcm16
from tests.wsclient import Client, wer

pytestmark = pytest.mark.slow  # a real server with the end-of-turn model

COMPLETE = "en_librispeech_3752-4944-0000.wav"  # "captain frere says that the scenery is delightful"
PAUSED = "en_librispeech_1988-24833-0003.wav"  # "when are you getting rid of these cats i'm not fixing to
# start an annex | to kate's cat home": cut after "annex" (word end found with faster-whisper tiny.en)
CUT_S = 3.70
PAUSE_S = 1.0


@pytest.fixture(scope="module")
def smart_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("smart") / "serve.log"
    with running_server(log, "--slo-ms", "60000", "--end-of-turn", "smart-turn") as (port, proc):
        yield {"url": f"ws://127.0.0.1:{port}/ws", "http": f"http://127.0.0.1:{port}", "log": log}


def zeros(s: float) -> np.ndarray:
    return np.zeros(int(s * 16000), np.float32)


def paused_turn(audio_dir) -> np.ndarray:
    x = clip16k(audio_dir, PAUSED)
    cut = int(CUT_S * 16000)
    return np.concatenate([zeros(0.3), x[:cut], zeros(PAUSE_S), x[cut:], zeros(2.5)])


async def test_a_finished_sentence_ends_on_the_models_word(smart_server, audio_dir):
    x = np.concatenate([zeros(0.3), clip16k(audio_dir, COMPLETE), zeros(2.5)])
    async with Client(smart_server["url"]) as c:
        await c.start(sample_rate=16000)
        await c.send_audio(pcm16(x))
        stopped = await c.wait_for("speech.stopped")
        assert stopped["reason"] == "end_of_turn", stopped
        await c.wait_for("response.done")


async def test_a_thinking_pause_mid_sentence_keeps_one_turn(smart_server, audio_dir, manifest):
    async with Client(smart_server["url"]) as c:
        await c.start(sample_rate=16000)
        await c.send_audio(pcm16(paused_turn(audio_dir)))
        await c.wait_for("response.done")
        stops = c.conv.of("speech.stopped")
        assert len(stops) == 1, stops
        assert stops[0]["audio_ms"] > (0.3 + CUT_S + PAUSE_S) * 1000, stops  # after the pause
        (final,) = c.conv.of("transcript.final")
        assert wer(manifest[PAUSED]["reference_transcript"], final["text"]) <= 0.25, final
        assert len(c.conv.of("response.started")) == 1


async def test_the_silence_rule_cuts_the_same_pause(smart_server, audio_dir):
    """The same audio with ``end_of_turn: silence`` chosen in session.start: 500 ms of
    silence ends the turn inside the pause (today's behaviour, and the contrast)."""
    async with Client(smart_server["url"]) as c:
        await c.start(sample_rate=16000, end_of_turn="silence")
        await c.send_audio(pcm16(paused_turn(audio_dir)))
        await c.wait_until(lambda: len(c.conv.of("speech.stopped")) >= 2, what="two speech.stopped")
        first = c.conv.of("speech.stopped")[0]
        assert first["reason"] == "silence"
        assert first["audio_ms"] < (0.3 + CUT_S + PAUSE_S) * 1000, first  # inside the pause
