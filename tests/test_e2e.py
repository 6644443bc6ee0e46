"""End to end through a real server on loopback with the real models (SmolLM2 for speed)."""

from __future__ import annotations

import asyncio
import urllib.request

import numpy as np
import pytest

from audio.pcm import resample
from audio.wav import read_mono
from tests.wsclient import CONTROL_DEADLINE_S, Client, normalize, wer

pytestmark = pytest.mark.slow  # every test here runs a real server (and the jfk_turn ones Whisper too)

JFK = "en_jfk_inaugural_1961.wav"
MUSIC = "xx_hard_music_brahms_hungarian_dance5_30s.wav"


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def clip16k(audio_dir, name) -> np.ndarray:
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, 16000)


@pytest.fixture(scope="module")
async def jfk_turn(server, audio_dir):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, format="pcm16", channels=1, output_sample_rate=22050)
        done = await c.turn(pcm16(clip16k(audio_dir, JFK)))
        yield c.conv, done


async def test_jfk_transcript_within_wer(jfk_turn, manifest):
    conv, done = jfk_turn
    assert done["type"] == "response.done", conv.events
    ref = manifest[JFK]["reference_transcript"]
    final = conv.of("transcript.final")[-1]["text"]
    assert wer(ref, final) <= 0.15, final
    started = [e for e in conv.of("response.started") if e["response_id"] == done["response_id"]][0]
    assert wer(ref, started["user_text"]) <= 0.15


async def test_jfk_reply_text_and_audio(jfk_turn):
    conv, done = jfk_turn
    assert done["text"].strip(), "empty reply"
    deltas = "".join(e["delta"] for e in conv.of("response.text.delta") if e["response_id"] == done["response_id"])
    assert deltas == done["text"]
    audio = conv.reply_audio(done["response_id"])
    assert len(audio) / 22050 >= 0.5
    assert float(np.sqrt(np.mean(audio**2))) > 0.01, "reply audio is silent"
    for key in ("asr", "llm_ttft", "first_audio", "voice_to_voice"):
        assert done["timings_ms"][key] >= 0


async def test_reply_audio_says_reply_text(jfk_turn):
    """Transcribe the reply audio back with the ASR model: it must say the reply text."""
    from pipeline.asr.engine import AsrEngine
    from pipeline.asr.loader import load_whisper
    from pipeline.asr.types import AsrRequest
    from pipeline.config import AsrConfig

    conv, done = jfk_turn
    audio = resample(conv.reply_audio(done["response_id"]), 22050, 16000)
    cfg = AsrConfig()
    engine = AsrEngine(load_whisper(cfg), cfg)
    heard = engine.transcribe(AsrRequest(audio)).text
    assert wer(done["text"], heard) <= 0.35, (done["text"], heard)


async def test_music_gives_no_transcript_and_no_reply(server, audio_dir):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        done = await c.turn(pcm16(clip16k(audio_dir, MUSIC)))
        assert done["type"] == "turn.empty"
        assert not c.conv.of("transcript.final")
        assert not c.conv.of("response.started")
        assert not c.conv.audio


@pytest.mark.parametrize(
    "frame, code",
    [
        ("hello", "bad_json"),
        ("{bad", "bad_json"),
        ("[]", "bad_json"),
        ("123", "bad_json"),
        ("null", "bad_json"),
        ('{"type": null}', "unknown_type"),
        ('{"type": "no.such.event"}', "unknown_type"),
        ('{"type": "text.input"}', "bad_event"),
        ('{"type": "text.input", "text": 5}', "bad_event"),
        ('{"type": "session.start", "sample_rate": "16000"}', "bad_event"),
        ('{"type": "session.start", "language": 5}', "bad_event"),
        ('{"type": "session.start", "channels": 3}', "bad_event"),
        ('{"type": "session.start", "sample_rate": 96000}', "bad_event"),
        ('{"type": "session.start", "format": "mp3"}', "bad_event"),
        ('{"type": "text.input", "text": "' + "x" * 100_000 + '"}', "bad_event"),
    ],
)
async def test_bad_text_frames_get_error_and_session_goes_on(server, frame, code):
    async with Client(server["url"]) as c:
        await c.send_json(frame)
        err = await c.wait_for("error", CONTROL_DEADLINE_S)
        assert err["code"] == code and err["fatal"] is False
        await c.start(sample_rate=16000)  # the session still works
        assert len(c.conv.of("error")) == 1


async def test_audio_before_start_is_an_error_then_a_valid_turn_works(server, audio_dir):
    x = clip16k(audio_dir, "en_cmu_goforward.wav")
    async with Client(server["url"]) as c:
        await c.ws.send(pcm16(x[:3200]))
        err = await c.wait_for("error", CONTROL_DEADLINE_S)
        assert err["code"] == "no_session"
        for bad in ("hello", "[]", '{"type": 1}'):
            await c.send_json(bad)
        await c.start(sample_rate=16000)
        done = await c.turn(pcm16(x))
        assert done["type"] == "response.done" and done["text"]
        assert "forward" in normalize(c.conv.of("transcript.final")[-1]["text"])


async def test_unknown_extra_fields_are_ignored(server):
    async with Client(server["url"]) as c:
        ev = await c.start(sample_rate=16000, model_size="large", extra={"x": 1})
        assert ev["input"]["sample_rate"] == 16000


async def _transcript(url, start: dict, data: bytes, chunk: int = 3200) -> str:
    async with Client(url) as c:
        await c.start(**start)
        n = len(c.conv.events)
        await c.send_audio(data, chunk)
        await c.send_json({"type": "input.end"})
        ev = await c.wait_for(lambda e: e["type"] in ("transcript.final", "turn.empty", "error")
                              and c.conv.events.index(e) >= n)
        await c.send_json({"type": "response.cancel"})
        assert ev["type"] == "transcript.final", c.conv.events
        return ev["text"]


async def test_formats_give_the_same_transcript(server, audio_dir):
    """16 kHz mono PCM16, 16 kHz mono f32 and 48 kHz stereo PCM16 (odd chunk sizes)."""
    x = clip16k(audio_dir, "en_librispeech_3752-4944-0000.wav")
    base = await _transcript(server["url"], {"sample_rate": 16000}, pcm16(x))
    f32 = await _transcript(server["url"], {"sample_rate": 16000, "format": "f32"}, x.astype("<f4").tobytes(), 4095)
    x48 = resample(x, 16000, 48000)
    stereo = np.stack([x48, x48 * 0.9], axis=1).reshape(-1)
    st = await _transcript(server["url"], {"sample_rate": 48000, "channels": 2}, pcm16(stereo), 641)
    assert normalize(base) == normalize(f32) == normalize(st)
    assert "scenery" in normalize(base)


async def test_f32_sent_as_pcm16_is_rejected(server, audio_dir):
    x = clip16k(audio_dir, "en_cmu_goforward.wav")
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, format="pcm16")
        await c.send_audio(x.astype("<f4").tobytes())
        err = await c.wait_for("error")  # found while decoding the audio, behind the VAD
        assert err["code"] == "bad_audio" and "f32" in err["message"]
        await asyncio.sleep(1.5)  # the rest of the stream is dropped, not decoded as PCM16 noise
        kinds = [e["type"] for e in c.conv.events]
        assert kinds.count("error") == 1 and "speech.started" not in kinds, kinds
        await c.start(sample_rate=16000, format="f32")  # declared right: it works
        done = await c.turn(x.astype("<f4").tobytes())
        assert "forward" in normalize(c.conv.of("transcript.final")[-1]["text"]), done


async def test_pcm16_sent_as_f32_is_rejected(server, audio_dir):
    x = clip16k(audio_dir, "en_cmu_goforward.wav")
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, format="f32")
        await c.send_audio(pcm16(x))
        err = await c.wait_for("error")
        assert err["code"] == "bad_audio"
        await asyncio.sleep(1.0)
        assert len(c.conv.of("error")) == 1  # reported once, not once per frame


async def test_text_input_turn(server):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "What is the capital of France?"})
        done = await c.wait_for("response.done")
        assert "paris" in done["text"].lower()
        assert len(c.conv.reply_audio(done["response_id"])) > 8000


async def test_oversize_message_closes_only_that_connection(server):
    async with Client(server["url"]) as big:
        await big.start(sample_rate=16000, format="f32")
        await big.ws.send(b"\0" * (10 * 1024 * 1024))
        await big.ws.wait_closed()
        assert big.ws.close_code == 1009
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)


def test_healthz_and_metrics(server):
    with urllib.request.urlopen(server["http"] + "/healthz") as r:
        assert r.status == 200
    with urllib.request.urlopen(server["http"] + "/metrics") as r:
        body = r.read().decode()
    assert "voxpipe_llm_ttft_seconds" in body and "voxpipe_queue_depth" in body


async def test_pause_mid_thought_gives_one_reply_to_the_whole_utterance(server, audio_dir, manifest):
    """A 1.8 s pause (inside the 2 s merge window, longer than the 500 ms endpoint): the
    first reply is cancelled and the whole utterance is answered (the audio from before
    the pause must survive buffer trimming while the resumed speech is being confirmed)."""
    x = clip16k(audio_dir, JFK)
    cut = int(2.7 * 16000)  # inside JFK's pause after "Americans"
    gap = np.zeros(int(0.7 * 16000), np.float32)  # JFK's 1.05 s pause becomes ~1.75 s
    x = np.concatenate([x[:cut], gap, x[cut:]])
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        # real-time pace matters here: the merge happens while the first reply is pending
        for i in range(0, len(x), 1600):
            await c.ws.send(pcm16(x[i : i + 1600]))
            await asyncio.sleep(0.1)
        await c.send_json({"type": "input.end"})
        ref = manifest[JFK]["reference_transcript"]
        whole = await c.wait_for(lambda e: e["type"] == "response.started" and wer(ref, e["user_text"]) <= 0.15)
        done = await c.wait_for(lambda e: e["type"] == "response.done" and e["response_id"] == whole["response_id"])
        assert done["text"]


async def test_invalid_utf8_text_frame_closes_only_that_connection(server):
    """RFC 6455 §8.1 requires failing the connection (1007); other sessions go on."""
    async with Client(server["url"]) as other:
        await other.start(sample_rate=16000)
        async with Client(server["url"]) as bad:
            await bad.start(sample_rate=16000)
            await bad.ws.send(b"\xff\xfe{bad", text=True)
            await bad.ws.wait_closed()
            assert bad.ws.close_code == 1007
        await other.send_json({"type": "text.input", "text": "Say hi."})
        assert (await other.wait_for("response.done"))["text"]


async def test_tiny_and_odd_audio_frames_still_transcribe(server, audio_dir):
    """Tiny and odd frames: 1-, 3- and 321-byte frames; samples split across frames are reassembled."""
    x = clip16k(audio_dir, "en_cmu_goforward.wav")
    data = pcm16(x)
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        sizes, i, k = [1, 3, 321], 0, 0
        while i < len(data):
            n = sizes[k % 3] if i < 4000 else 3201  # the first frames tiny, then odd-sized
            await c.ws.send(data[i : i + n])
            i, k = i + n, k + 1
        await c.ws.send(b"\x01")  # a dangling half sample at the end
        await c.send_json({"type": "input.end"})
        ev = await c.wait_for(lambda e: e["type"] in ("transcript.final", "turn.empty"))
        assert ev["type"] == "transcript.final" and "forward" in normalize(ev["text"])
        assert not c.conv.of("error")


async def test_language_on_an_english_only_model_is_reported(server):
    """tiny.en cannot decode German: say so instead of silently transcribing it as English."""
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, language="de")
        err = c.conv.of("error")
        assert len(err) == 1 and err[0]["code"] == "bad_event" and "English-only" in err[0]["message"]
        assert err[0]["fatal"] is False and c.conv.of("session.started")


def test_a_very_long_path_is_a_404_not_a_server_error(server):
    """A 4,000-character path raised OSError (file name too long) inside the request
    handler: a 500 and a traceback. No such file: 404."""
    import urllib.error

    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server["http"] + "/" + "a" * 4000, timeout=30)
    assert err.value.code == 404
