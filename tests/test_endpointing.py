"""Endpointer with scripted VAD probabilities (32 ms windows)."""

from pipeline.config import TurnConfig
from pipeline.session.endpointing import Endpointer, SpeechEnd, SpeechPause, SpeechResume, SpeechStart

W = 512


def run(probs, **kw):
    ep = Endpointer(TurnConfig(**kw))
    return ep, ep.feed(probs)


def test_speech_then_silence_ends_turn():
    ep, evs = run([0.0] * 5 + [0.9] * 20 + [0.0] * 20)
    assert evs[0] == SpeechStart(5 * W)
    assert evs[1] == SpeechPause(5 * W, 25 * W)
    end = evs[2]
    assert isinstance(end, SpeechEnd) and end.reason == "silence"
    assert end.start == 5 * W and end.end == 25 * W


def test_short_burst_is_not_speech():
    _, evs = run([0.0] * 5 + [0.9] * 3 + [0.0] * 40)  # 96 ms < 250 ms
    assert evs == []


def test_pause_shorter_than_end_silence_keeps_the_turn():
    _, evs = run([0.9] * 20 + [0.1] * 10 + [0.9] * 20 + [0.0] * 20)  # 320 ms pause
    assert [type(e) for e in evs] == [SpeechStart, SpeechPause, SpeechResume, SpeechPause, SpeechEnd]
    _, evs = run([0.9] * 20 + [0.1] * 10 + [0.9] * 20 + [0.0] * 20, early_end_ms=0)  # speculation off
    assert [type(e) for e in evs] == [SpeechStart, SpeechEnd]


def test_pause_event_comes_at_early_end_then_end_at_end_silence():
    ep = Endpointer(TurnConfig(early_end_ms=200, end_silence_ms=500))
    assert [type(e) for e in ep.feed([0.9] * 20)] == [SpeechStart]
    evs = ep.feed([0.0] * 6)  # 192 ms: not yet
    assert evs == []
    evs = ep.feed([0.0])  # 224 ms of silence
    assert evs == [SpeechPause(0, 20 * W)]
    assert ep.feed([0.0] * 8) == []  # once per silence; 480 ms
    end = ep.feed([0.0])  # 512 ms
    assert len(end) == 1 and isinstance(end[0], SpeechEnd) and end[0].end == 20 * W


def test_speech_after_a_pause_resumes_the_turn():
    ep = Endpointer(TurnConfig(early_end_ms=200, end_silence_ms=500))
    ep.feed([0.9] * 20 + [0.0] * 8)
    evs = ep.feed([0.9] * 3)
    assert evs == [SpeechResume(28 * W)]
    assert ep.in_speech


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
