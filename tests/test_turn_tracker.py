"""The turn tracker with a scripted VAD and real numpy audio: events, positions, slices."""

from __future__ import annotations

import numpy as np

from audio.vad import WINDOW
from pipeline.config import TurnConfig
from pipeline.session.endpointing import AllSpeech
from pipeline.session.turn_tracker import PREROLL, VAD_PIECE_SAMPLES, TurnTracker
from pipeline.session.types import SpeechEnd, SpeechPause, SpeechResume, SpeechStart
from tests.fakes import ScriptedVadStream

CFG = TurnConfig(min_speech_ms=250, end_silence_ms=500, early_end_ms=200, pad_ms=200)
MS_PER_WIN = WINDOW * 1000 / 16000  # 32 ms


def wins(ms: float) -> int:
    return int(round(ms / MS_PER_WIN))


def ramp(n: int, start: int = 0) -> np.ndarray:
    """Audio whose every sample is its own stream position (so slices are checkable)."""
    return np.arange(start, start + n, dtype=np.float32)


def feed_windows(tr: TurnTracker, n_windows: int, frame: int = 320) -> list:
    """Feed ``n_windows`` windows of ramp audio in ``frame``-sample frames; return the events."""
    events = []
    target = tr.pos + n_windows * WINDOW
    while tr.pos < target:
        events += tr.feed(ramp(min(frame, target - tr.pos), tr.pos))
    return events


def test_speech_start_pause_resume_end_positions():
    probs = [0.0] * 10 + [0.9] * wins(400) + [0.0] * wins(300) + [0.9] * wins(300) + [0.0] * wins(600)
    tr = TurnTracker(CFG, ScriptedVadStream(probs))
    events = feed_windows(tr, len(probs))
    start = 10 * WINDOW
    first_end = start + wins(400) * WINDOW
    resume = first_end + wins(300) * WINDOW
    end = resume + wins(300) * WINDOW
    assert events == [SpeechStart(start), SpeechPause(start, first_end), SpeechResume(resume),
                      SpeechPause(start, end), SpeechEnd(start, end, "silence")]


def test_short_burst_is_not_speech():
    probs = [0.0] * 5 + [0.9] * wins(150) + [0.0] * wins(800)
    tr = TurnTracker(CFG, ScriptedVadStream(probs))
    assert feed_windows(tr, len(probs)) == []
    assert tr.finish() is None


def test_finish_ends_confirmed_speech_at_input_end():
    probs = [0.9] * wins(400)
    tr = TurnTracker(CFG, ScriptedVadStream(probs, default=0.9))
    assert feed_windows(tr, len(probs)) == [SpeechStart(0)]
    assert tr.finish() == SpeechEnd(0, len(probs) * WINDOW, "input_end")


def test_since_gives_the_pre_roll_and_the_speech():
    pre = 40  # windows of silence before the speech (1.28 s)
    probs = [0.0] * pre + [0.9] * wins(300)
    tr = TurnTracker(CFG, ScriptedVadStream(probs))
    events = feed_windows(tr, len(probs))
    start = pre * WINDOW
    assert events == [SpeechStart(start)]
    audio = tr.since(start)
    np.testing.assert_array_equal(audio, ramp(tr.pos - (start - tr.pad), start - tr.pad))


def test_trimming_bounds_the_buffer_and_keeps_the_pre_roll():
    tr = TurnTracker(CFG, ScriptedVadStream([0.0] * 2000 + [0.9] * 30))
    feed_windows(tr, 2000)  # 64 s of silence
    assert tr.buffered <= 2 * PREROLL + 320  # trimmed (amortised: at most twice the keep)
    events = feed_windows(tr, 30)
    start = 2000 * WINDOW
    assert events == [SpeechStart(start)]
    np.testing.assert_array_equal(tr.since(start), ramp(tr.pos - (start - tr.pad), start - tr.pad))
    # asking for audio that was trimmed gives only what is left, from the oldest kept sample
    old = tr.audio(0, 100)
    assert len(old) == 0


def test_unconfirmed_speech_keeps_its_pre_roll_through_trims():
    # speech that takes 3 s to confirm: many trims happen while it is a candidate; when
    # the SpeechStart comes, its pre-roll must still be there (it is handed to the ASR)
    cfg = TurnConfig(min_speech_ms=3000, end_silence_ms=500, early_end_ms=0, pad_ms=200)
    tr = TurnTracker(cfg, ScriptedVadStream([0.0] * 100, default=0.9))
    feed_windows(tr, 100)
    events: list = []
    while not events:
        events = tr.feed(ramp(320, tr.pos))
    start = 100 * WINDOW
    assert events == [SpeechStart(start)]
    assert tr.pos - start > 2 * PREROLL  # the trim had the chance to cut it
    np.testing.assert_array_equal(tr.since(start), ramp(tr.pos - (start - tr.pad), start - tr.pad))
    # once confirmed, the next frames let the buffer shrink back to about a second
    feed_windows(tr, 100)
    assert tr.buffered <= 2 * PREROLL + 320


def test_tail_after_counts_samples_past_the_pad():
    tr = TurnTracker(CFG, ScriptedVadStream([]))
    tr.feed(ramp(16000))
    assert tr.tail_after(10000) == 16000 - (10000 + tr.pad)
    assert tr.tail_after(15990) == 0


def test_split_feeding_matches_feed_and_large_frames_run_in_pieces():
    probs = [0.0] * 10 + [0.9] * 40 + [0.0] * 30
    a = TurnTracker(CFG, ScriptedVadStream(probs))
    b = TurnTracker(CFG, ScriptedVadStream(probs))
    x = ramp(len(probs) * WINDOW)
    assert len(x) > VAD_PIECE_SAMPLES
    b.append(x)
    events_b = b.endpoint(b.detect(x))
    assert a.feed(x) == events_b == [SpeechStart(10 * WINDOW), SpeechPause(10 * WINDOW, 50 * WINDOW),
                                      SpeechEnd(10 * WINDOW, 50 * WINDOW, "silence")]
    assert len(b.detect(np.zeros(3 * VAD_PIECE_SAMPLES + 100, np.float32))) == (3 * VAD_PIECE_SAMPLES + 100) // WINDOW


def test_all_speech_mode_starts_at_the_first_sample():
    tr = TurnTracker(CFG, AllSpeech())
    assert tr.feed(ramp(16000)) == [SpeechStart(0)]
    assert tr.finish() == SpeechEnd(0, 16000 - 16000 % WINDOW, "input_end")
