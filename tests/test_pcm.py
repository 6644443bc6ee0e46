"""PCM decoding: odd byte counts, formats, channels, resampling."""

import numpy as np
import pytest

from audio.pcm import AudioFormatError, PcmDecoder, PcmFormat, float_to_pcm16, looks_like_f32, resample


def tone(rate: int, seconds: float = 1.0, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def decode_all(fmt: PcmFormat, data: bytes, sizes) -> np.ndarray:
    dec = PcmDecoder(fmt)
    out, i, k = [], 0, 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        out.append(dec.feed(data[i : i + n]))
        i, k = i + n, k + 1
    out.append(dec.flush())
    return np.concatenate(out)


@pytest.mark.parametrize("sizes", [[1], [3], [321], [4095], [1, 3, 640, 768, 7]])
def test_odd_chunk_sizes_lose_and_duplicate_nothing(sizes):
    x = tone(16000, 0.5)
    data = (x * 32767).astype("<i2").tobytes()
    got = decode_all(PcmFormat(16000, "pcm16", 1), data, sizes)
    assert len(got) == len(x)
    np.testing.assert_allclose(got, x, atol=2 / 32767)  # int16 truncation


def test_f32_six_byte_frames_carry_over():
    x = tone(16000, 0.1)
    got = decode_all(PcmFormat(16000, "f32", 1), x.astype("<f4").tobytes(), [6])
    np.testing.assert_array_equal(got, x)


def test_trailing_partial_sample_is_dropped():
    dec = PcmDecoder(PcmFormat(16000, "pcm16", 1))
    assert len(dec.feed(b"\x01\x00\x02")) == 1
    assert len(dec.flush()) == 0


def test_stereo_48k_matches_mono_16k():
    x16 = tone(16000, 1.0, 300)
    x48 = resample(x16, 16000, 48000)
    stereo = np.stack([x48, x48], axis=1).reshape(-1)
    got = decode_all(PcmFormat(48000, "pcm16", 2), (stereo * 32767).astype("<i2").tobytes(), [640, 768])
    assert abs(len(got) - len(x16)) <= 2
    n = min(len(got), len(x16)) - 200
    assert np.max(np.abs(got[100:n] - x16[100:n])) < 0.01


def test_f32_declared_but_pcm16_sent_is_rejected():
    data = (tone(16000) * 32767).astype("<i2").tobytes()
    with pytest.raises(AudioFormatError):
        PcmDecoder(PcmFormat(16000, "f32", 1)).feed(data)


def test_pcm16_declared_but_f32_sent_is_rejected():
    data = tone(16000).astype("<f4").tobytes()
    assert looks_like_f32(data)
    with pytest.raises(AudioFormatError):
        PcmDecoder(PcmFormat(16000, "pcm16", 1)).feed(data)


def test_real_pcm16_speech_is_not_mistaken_for_f32(audio_dir):
    from audio.wav import read_mono

    x, _ = read_mono(audio_dir / "en_librispeech_3752-4944-0000.wav")
    data = (x * 32767).astype("<i2").tobytes()
    for off in range(0, len(data) - 4096, 16000):
        assert not looks_like_f32(data[off : off + 4096])


def test_silence_is_accepted_in_both_formats():
    for fmt, data in (("pcm16", bytes(3200)), ("f32", bytes(6400))):
        assert len(PcmDecoder(PcmFormat(16000, fmt, 1)).feed(data)) == 1600


@pytest.mark.parametrize("dither", [1, 3, 30])
def test_near_silent_pcm16_is_accepted(dither):
    """Digital near-silence (zeros with sparse small values, as a muted mic sends) once
    read as clean float32 because zeros dominated; it must decode as PCM16."""
    rng = np.random.default_rng(dither)
    x = np.zeros(16000, np.int16)
    hits = rng.choice(len(x), 400, replace=False)
    x[hits] = rng.integers(-dither, dither + 1, len(hits))
    out = PcmDecoder(PcmFormat(16000, "pcm16", 1)).feed(x.astype("<i2").tobytes())
    assert len(out) == 16000 and np.max(np.abs(out)) <= (dither + 1) / 32768


def test_f32_after_leading_silence_is_still_caught():
    """The check waits for enough non-zero samples instead of passing on silence."""
    dec = PcmDecoder(PcmFormat(16000, "pcm16", 1))
    dec.feed(bytes(8192))  # silence decides nothing
    with pytest.raises(AudioFormatError):
        dec.feed(tone(16000).astype("<f4").tobytes())


def test_client_frames_round_pcm16_exactly(tmp_path):
    from audio.wav import write_wav
    from clients.turn import pcm16_frames

    x = np.arange(-16000, 16000, 7, dtype=np.int16)  # |x| < 16384: x * 32767 / 32768 rounds back to x
    path = tmp_path / "ramp.wav"
    write_wav(path, x, 16000)
    frames, rate, ch = pcm16_frames(str(path))
    got = np.frombuffer(b"".join(frames), dtype="<i2")
    assert rate == 16000 and ch == 1
    assert np.array_equal(got, x)  # truncation made every non-zero sample one step smaller


@pytest.mark.parametrize("kw", [dict(sample_rate=7999), dict(channels=3), dict(format="mp3")])
def test_bad_formats_raise(kw):
    args = dict(sample_rate=16000, format="pcm16", channels=1) | kw
    with pytest.raises(ValueError):
        PcmFormat(**args)


@pytest.mark.parametrize("rate", [8000, 44100, 48000])
def test_audio_after_the_end_of_input_starts_a_fresh_stream(rate):
    """input.end, then more audio on the same socket (the web demo's second push-to-talk
    turn at 48 kHz): the resampler's stream had ended ("Input after last input" killed the
    session); the next turn decodes like the first."""
    dec = PcmDecoder(PcmFormat(rate, "pcm16", 1))
    tone = float_to_pcm16(0.3 * np.sin(2 * np.pi * 440 * np.arange(rate) / rate).astype(np.float32))
    first = np.concatenate([dec.feed(tone), dec.flush()])
    second = np.concatenate([dec.feed(tone), dec.flush()])
    assert abs(len(first) - 16000) <= 16 and abs(len(second) - 16000) <= 16
    assert np.allclose(first, second, atol=1e-4)


@pytest.mark.parametrize("frame_samples", [128, 1024, 4096])
def test_undeclared_f32_after_digital_silence_is_rejected_in_small_frames(audio_dir, frame_samples):
    """A browser's 48 kHz float32 sent with a bare ``session.start`` (PCM16 16 kHz assumed):
    speech after leading digital silence, resampled (soxr rings at ~1e-11 into the silence),
    in small frames. The check must judge the speech, not the ringing, and refuse it — it
    once took the ringing as PCM16 and never looked again (the attack pass, CASES C05)."""
    from audio.wav import read_mono

    x, rate = read_mono(audio_dir / "en_jfk_inaugural_1961.wav")
    f32 = resample(x[: 4 * rate], rate, 48000).astype("<f4").tobytes()
    dec = PcmDecoder(PcmFormat(16000, "pcm16", 1))
    step = frame_samples * 4
    with pytest.raises(AudioFormatError, match="float32"):
        for i in range(0, len(f32), step):
            dec.feed(f32[i : i + step])
