"""The level gate in front of Silero VAD (audio/vad_gate.py): a silent stream costs no
model call, and speech is detected exactly as without the gate."""

from __future__ import annotations

import numpy as np
import pytest

from audio.pcm import resample
from audio.vad import WINDOW, SileroVad
from audio.vad_gate import ABS_GATE_DBFS, IDLE_WINDOWS, RISE_DB, LevelGate, window_dbfs
from audio.wav import read_mono
from pipeline import model_files


def test_window_level():
    x = np.zeros((2, WINDOW), np.float32)
    x[1] = 0.5
    db = window_dbfs(x)
    assert db[0] < -200 and db[1] == pytest.approx(20 * np.log10(0.5), abs=1e-6)


def test_gate_waits_for_idle_then_skips_quiet_and_passes_rises():
    g = LevelGate()
    for _ in range(IDLE_WINDOWS):  # not idle yet: every window goes to the model
        assert g.needs_model(-60.0)
        g.observe(-60.0, 0.0, skipped=False)
    assert not g.needs_model(ABS_GATE_DBFS - 1)  # digital silence
    assert not g.needs_model(-60.0 + RISE_DB - 1)  # noise at the floor
    assert g.needs_model(-60.0 + RISE_DB + 1)  # a rise: maybe speech
    g.observe(-40.0, 0.9, skipped=False)  # speech: the gate opens until idle again
    assert g.needs_model(-80.0)


def test_floor_follows_the_room_slowly_up_and_quickly_down():
    g = LevelGate()
    for _ in range(IDLE_WINDOWS):
        g.observe(-60.0, 0.0, skipped=False)
    for _ in range(200):  # a fan turned on: louder non-speech windows, judged by the model
        g.observe(-45.0, 0.0, skipped=False)
    assert g.floor_db == pytest.approx(-45.0, abs=0.5)
    assert not g.needs_model(-44.0)
    for _ in range(20):
        g.observe(-60.0, 0.0, skipped=True)
    assert g.floor_db == pytest.approx(-60.0, abs=0.5)


@pytest.fixture(scope="module")
def vads():
    path = model_files.silero_vad_path()
    return SileroVad(path), SileroVad(path, gate=False)


def _probs(vad, x):
    s = vad.stream()
    return np.concatenate([s.feed(x[i:i + 320]) for i in range(0, len(x), 320)]), s.skipped


@pytest.mark.parametrize("clip", ["en_jfk_inaugural_1961.wav", "en_librispeech_1988-24833-0003.wav",
                                  "en_librispeech_1995-1837-0001.wav", "en_cmu_goforward.wav"])
def test_gated_vad_finds_the_same_speech(vads, audio_dir, clip):
    """The quietest clips (speech down to -61 dBFS) with silence around them: the same
    speech windows with and without the gate (a window or two may differ at a boundary,
    the model state being a few windows older), and the silence skipped."""
    x, sr = read_mono(audio_dir / clip)
    x = resample(x, sr, 16000)
    pad = np.zeros(16000, np.float32)
    x = np.concatenate([pad, x, pad])
    gated, skipped = _probs(vads[0], x)
    plain, none = _probs(vads[1], x)
    assert none == 0 and skipped >= 16000 // WINDOW  # at least the second of silence after the clip
    on, ref = gated > 0.5, plain > 0.5
    assert ref.sum() > 20
    assert (on != ref).sum() <= max(2, ref.sum() // 25)


def test_silent_and_quiet_streams_skip_almost_every_window(vads):
    rng = np.random.default_rng(0)
    for x in (np.zeros(16000 * 5, np.float32), (rng.standard_normal(16000 * 5) * 10 ** (-65 / 20)).astype(np.float32)):
        probs, skipped = _probs(vads[0], x)
        assert len(probs) - skipped <= IDLE_WINDOWS + 2
        assert probs.max() < 0.5


def _at(x: np.ndarray, dbfs: float) -> np.ndarray:
    return (x * 10 ** ((dbfs - float(window_dbfs(x[None, :])[0])) / 20)).astype(np.float32)


def test_a_quieter_voice_after_a_skipped_stretch_is_speech_as_in_a_fresh_stream(vads, audio_dir):
    """Speech, 4 s the gate skips (a client's echo canceller sending near-silence while a
    reply plays), then a voice 15 dB quieter (-40 dBFS): its windows are speech as often as
    in a stream of its own. With the LSTM state kept over the skipped run (the state of the
    first speech's end), 40 % of them were lost (FRESH_AFTER)."""
    def clip(name: str) -> np.ndarray:
        x, sr = read_mono(audio_dir / name)
        return resample(x, sr, 16000)

    rng = np.random.default_rng(0)
    near_silence = (rng.standard_normal(16000 * 4) * 10 ** (-95 / 20)).astype(np.float32)
    first, voice = _at(clip("en_librispeech_3752-4944-0000.wav"), -25), _at(clip("en_jfk_inaugural_1961.wav"), -40)
    after, skipped = _probs(vads[0], np.concatenate([first, near_silence, voice]))
    assert skipped >= 3 * 16000 // WINDOW  # the quiet stretch went by the model
    alone, _ = _probs(vads[0], np.concatenate([near_silence, voice]))
    tail, ref = after[-(len(voice) // WINDOW):] > 0.5, alone[-(len(voice) // WINDOW):] > 0.5
    assert ref.sum() > 100
    assert tail.sum() >= 0.95 * ref.sum(), (tail.sum(), ref.sum())


def test_speech_going_on_after_a_pause_keeps_its_speaker_s_state(vads, audio_dir):
    """JFK's 1.05 s pause after "Americans" made 1.75 s of digital silence (the e2e test's
    pause mid-thought): "ask not" after it is speech, under the state of his own speech. From
    a zero state after the skipped windows it scored 0.1-0.4 and was lost."""
    x, sr = read_mono(audio_dir / "en_jfk_inaugural_1961.wav")
    x = resample(x, sr, 16000)
    cut = int(2.7 * 16000)
    x = np.concatenate([x[:cut], np.zeros(int(0.7 * 16000), np.float32), x[cut:]])
    gated, skipped = _probs(vads[0], x)
    assert skipped > 20  # the pause went by the model
    ask = gated[int(4.3 * 16000) // WINDOW:int(5.0 * 16000) // WINDOW]  # 21 windows
    assert (ask > 0.5).sum() >= 10, ask  # kept: 14 (without the gate: 3; from a zero state: 0)
