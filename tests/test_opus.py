"""Opus on the WebSocket: the codec wrapper (libopus via PyAV) on real speech, the packet
duration from the TOC byte, corrupt packets, and a real server (SmolLM2, Whisper, Piper)
holding a spoken turn in Opus both ways."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from audio.opus import OpusDecoder, OpusEncoder, packet_seconds
from audio.pcm import AudioFormatError, resample
from audio.wav import read_mono
from tests.wsclient import CONTROL_DEADLINE_S, Client, wer

JFK = "en_jfk_inaugural_1961.wav"


def speech16k(audio_dir, name: str) -> np.ndarray:
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, 16000)


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def opus_packets(x: np.ndarray, rate: int = 16000) -> list[bytes]:
    enc = OpusEncoder(rate, 24000)
    return enc.encode(pcm16(x)) + enc.flush()


def decoded(packets: list[bytes]) -> np.ndarray:
    dec = OpusDecoder()
    y, bad = dec.decode(packets)
    assert bad == 0
    return np.concatenate([y, dec.flush()])


def lag_of(y: np.ndarray, x: np.ndarray, most: int = 1600) -> int:
    """The delay of ``y`` behind ``x`` (samples, 0..most) that best lines them up."""
    m = min(len(x), len(y)) - most
    return int(np.argmax([np.dot(y[lag:lag + m], x[:m]) for lag in range(most)]))


# ---- the codec ------------------------------------------------------------------------------


@pytest.mark.parametrize("toc, tail, ms", [
    (0b01111_0_00, b"", 20.0),       # config 15: hybrid FB 20 ms, code 0: one frame
    (0b00011_0_00, b"", 60.0),       # config 3: SILK NB 60 ms
    (0b11100_0_01, b"", 5.0),        # config 28: CELT FB 5 ms, code 1: two frames
    (0b10000_0_00, b"", 2.5),        # config 16: CELT NB 2.5 ms
    (0b00001_1_11, bytes([6]), 120.0),   # config 1: SILK NB 20 ms, code 3: six frames
])
def test_a_packet_s_duration_comes_from_its_toc_byte(toc, tail, ms):
    assert packet_seconds(bytes([toc]) + tail + b"\x00" * 10) * 1000 == pytest.approx(ms)


@pytest.mark.parametrize("packet", [b"", bytes([0b00001_0_11]), bytes([0b00011_0_11, 3])])
def test_what_cannot_be_an_opus_packet_says_so(packet):
    with pytest.raises(AudioFormatError):
        packet_seconds(packet)  # empty; code 3 without its count; 3 × 60 ms = 180 ms > 120 ms


def test_real_speech_survives_the_round_trip(audio_dir):
    x = speech16k(audio_dir, "en_cmu_goforward.wav")
    packets = opus_packets(x)
    assert all(packet_seconds(p) == pytest.approx(0.02) for p in packets)
    assert len(packets) - -(-len(x) // 320) in (0, 1)  # every 20 ms, the tail padded (+ the codec's delay)
    assert sum(map(len, packets)) / (len(x) / 16000) <= 32000 / 8  # 1/8 of PCM16's bytes at 16 kHz, or less
    y = decoded(packets)
    lag = lag_of(y, x)
    assert 0 <= lag < 800, lag  # the codec's delay (a few ms)
    y = y[lag:lag + len(x)]
    # the envelope (20 ms RMS) follows the speech's: the same words, not just some sound
    env = [np.sqrt(np.mean(v.reshape(-1, 320) ** 2, axis=1)) for v in (x[: len(y) // 320 * 320],
                                                                       y[: len(y) // 320 * 320])]
    assert np.corrcoef(*env)[0, 1] > 0.95


def test_a_corrupt_packet_loses_only_its_own_audio(audio_dir):
    x = speech16k(audio_dir, "en_cmu_goforward.wav")
    packets = opus_packets(x)
    dec = OpusDecoder()
    mixed = packets[:10] + [b"", bytes([0b00011_0_11, 3])] + packets[10:]
    y, bad = dec.decode(mixed)
    assert bad == 2
    assert abs(len(y) - len(decoded(packets))) < 400  # all the packets' audio, less the resampler's tail


def test_stereo_packets_are_mixed_to_mono(audio_dir):
    import av

    x = speech16k(audio_dir, "en_cmu_goforward.wav")
    ctx = av.CodecContext.create("libopus", "w")
    ctx.sample_rate, ctx.layout, ctx.format, ctx.bit_rate = 16000, "stereo", "s16", 48000
    ctx.open()
    s16 = (np.clip(x, -1, 1) * 32767).astype(np.int16)
    packets: list[bytes] = []
    for i in range(0, len(s16) - 320, 320):
        frame = av.AudioFrame.from_ndarray(np.repeat(s16[i:i + 320], 2)[None, :], format="s16", layout="stereo")
        frame.sample_rate, frame.pts = 16000, i
        packets += [bytes(p) for p in ctx.encode(frame)]
    dec = OpusDecoder(channels=2)
    y, bad = dec.decode(packets)
    assert bad == 0 and abs(len(y) - len(x)) < 1600
    assert np.sqrt(np.mean(y ** 2)) == pytest.approx(np.sqrt(np.mean(x ** 2)), rel=0.3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=200), max_size=8))
def test_any_bytes_are_decoded_or_counted_never_raised(frames):
    y, bad = OpusDecoder().decode(frames)
    assert y.dtype == np.float32 and 0 <= bad <= len(frames)


def test_an_encoder_takes_only_opus_rates():
    with pytest.raises(ValueError, match="Opus takes"):
        OpusEncoder(22050)


# ---- a real server ------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_spoken_turn_in_opus_both_ways(server, audio_dir, manifest):
    x = speech16k(audio_dir, JFK)
    packets = opus_packets(resample(x, 16000, 48000), 48000)
    async with Client(server["url"]) as c:
        started = await c.start(sample_rate=48000, format="opus", output_format="opus", output_sample_rate=24000)
        assert started["input"]["format"] == started["output"]["format"] == "opus"
        n = len(c.conv.events)
        for i, p in enumerate(packets):
            await c.ws.send(p)
            if i == 50:  # two frames that are not Opus, mid-speech: reported, the turn goes on
                await c.ws.send(b"")
                await c.ws.send(b"\x03")
        await c.send_json({"type": "input.end"})
        done = await c.wait_for(lambda e: e["type"] in ("response.done", "turn.empty")
                                and c.conv.events.index(e) >= n)
        assert done["type"] == "response.done", c.conv.events
        errors = c.conv.of("error")
        assert [e["code"] for e in errors] == ["bad_audio"] and "not an Opus packet" in errors[0]["message"]
        final = c.conv.of("transcript.final")[-1]["text"]
        assert wer(manifest[JFK]["reference_transcript"], final) <= 0.15, final
        # the reply: Opus packets of 20 ms, the last one before response.done
        reply = c.conv.audio[done["response_id"]]
        assert all(packet_seconds(p) == pytest.approx(0.02) for p in reply)
        assert c.conv.audio_after_event(done["response_id"], done) == 0
        y = decoded(reply)
        assert len(y) / 16000 >= 0.5 and float(np.sqrt(np.mean(y ** 2))) > 0.01
        pcm_bytes_per_s = 24000 * 2
        assert sum(map(len, reply)) / (len(y) / 16000) <= pcm_bytes_per_s / 8
        # the same session back to PCM: a new session.start declares it
        await c.start(sample_rate=16000, format="pcm16")
        c.conv.events.clear()
        await c.send_json({"type": "text.input", "text": "Say hello."})
        done = await c.wait_for("response.done")
        assert len(c.conv.audio[done["response_id"]][0]) > 200  # PCM16 frames again (not 20 ms packets)


@pytest.mark.slow
@pytest.mark.parametrize("fields", [{"format": "opus", "sample_rate": 44100},
                                    {"output_format": "opus", "output_sample_rate": 22050},
                                    {"output_format": "ogg"}])
async def test_an_opus_session_start_with_a_rate_opus_lacks_is_a_clear_error(server, fields):
    async with Client(server["url"]) as c:
        await c.send_json({"type": "session.start", **fields})
        err = await c.wait_for("error", CONTROL_DEADLINE_S)
        assert err["code"] == "bad_event" and not err["fatal"], err
        assert "rate" in err["message"] or "output_format" in err["message"], err
        await c.start(sample_rate=16000)  # the session still works
