"""Endpointer with scripted VAD probabilities (32 ms windows)."""

from pipeline.config import TurnConfig
from pipeline.endpointing import Endpointer, SpeechEnd, SpeechStart

W = 512


def run(probs, **kw):
    ep = Endpointer(TurnConfig(**kw))
    return ep, ep.feed(probs)


def test_speech_then_silence_ends_turn():
    ep, evs = run([0.0] * 5 + [0.9] * 20 + [0.0] * 20)
    assert evs[0] == SpeechStart(5 * W)
    end = evs[1]
    assert isinstance(end, SpeechEnd) and end.reason == "silence"
    assert end.start == 5 * W and end.end == 25 * W


def test_short_burst_is_not_speech():
    _, evs = run([0.0] * 5 + [0.9] * 3 + [0.0] * 40)  # 96 ms < 250 ms
    assert evs == []


def test_pause_shorter_than_end_silence_keeps_the_turn():
    _, evs = run([0.9] * 20 + [0.1] * 10 + [0.9] * 20 + [0.0] * 20)  # 320 ms pause
    assert [type(e) for e in evs] == [SpeechStart, SpeechEnd]


def test_hysteresis_keeps_speech_between_thresholds():
    _, evs = run([0.9] * 10 + [0.4] * 30)
    assert [type(e) for e in evs] == [SpeechStart]


def test_max_turn_length_cuts():
    _, evs = run([0.9] * 200, max_turn_s=2.0)
    ends = [e for e in evs if isinstance(e, SpeechEnd)]
    assert ends and ends[0].reason == "max_length" and ends[0].end - ends[0].start <= 2.1 * 16000


def test_finish_ends_current_speech_or_returns_none():
    ep, _ = run([0.9] * 20)
    end = ep.finish()
    assert end is not None and end.reason == "input_end"
    assert ep.finish() is None
    ep2, _ = run([0.0] * 20)
    assert ep2.finish() is None
