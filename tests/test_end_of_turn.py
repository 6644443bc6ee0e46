"""The semantic end of turn, pure: the policy's decisions and the endpointer's checkpoints,
with scripted VAD probabilities (32 ms windows) and scripted model answers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.config import TurnConfig
from pipeline.session.end_of_turn import EAGERNESS, FIRST_CHECK_MS, EndOfTurnPolicy, eagerness
from pipeline.session.endpointing import Endpointer
from pipeline.session.types import SpeechCheck, SpeechEnd, SpeechPause, SpeechResume, SpeechStart

W = 512
WIN_MS = 32


def policy(name: str = "medium", fallback_ms: int = 500) -> EndOfTurnPolicy:
    return EndOfTurnPolicy(eagerness(name), fallback_ms=fallback_ms)


def endpointer(name: str = "medium") -> Endpointer:
    return Endpointer(TurnConfig(early_end_ms=200, end_silence_ms=500), policy(name))


def test_confident_complete_ends_at_once():
    d = policy().decide(0.9, 224)
    assert d.end and d.cause == "model"


def test_incomplete_waits_for_the_cap_without_asking_again():
    p = policy("medium")
    d = p.decide(0.1, 128)
    assert not d.end and not d.ask and d.next_check_ms == EAGERNESS["medium"].cap_ms
    assert p.at_unasked(EAGERNESS["medium"].cap_ms).cause == "cap"
    assert p.decide(0.1, EAGERNESS["medium"].cap_ms).end


def test_no_answer_falls_back_to_the_silence_rule():
    p = policy(fallback_ms=500)
    d = p.decide(None, 224)
    assert not d.end and not d.ask and d.next_check_ms == 500
    assert p.at_unasked(500).cause == "fallback"
    assert p.decide(float("nan"), 600).cause == "fallback"


def test_eagerness_orders_thresholds_and_caps():
    low, med, high = EAGERNESS["low"], EAGERNESS["medium"], EAGERNESS["high"]
    assert low.complete > med.complete > high.complete
    assert low.cap_ms > med.cap_ms > high.cap_ms
    assert eagerness("auto") == med
    with pytest.raises(ValueError):
        eagerness("eager")


@given(prob=st.floats(0.0, 1.0), silence=st.floats(0.0, 10_000.0), name=st.sampled_from(sorted(EAGERNESS)))
def test_a_turn_never_waits_past_its_cap(prob, silence, name):
    p = policy(name)
    d = p.decide(prob, silence)
    if silence >= p.setting.cap_ms:
        assert d.end
    if not d.end:
        assert d.next_check_ms is not None and silence < d.next_check_ms <= p.setting.cap_ms and not d.ask


def test_endpointer_stops_at_the_check_and_a_complete_answer_ends_the_turn():
    ep = endpointer()
    evs = ep.feed([0.9] * 20 + [0.0] * 30)  # the check comes after 128 ms of silence
    assert [type(e) for e in evs] == [SpeechStart, SpeechCheck]
    check = evs[-1]
    assert isinstance(check, SpeechCheck) and check.end == 20 * W and check.at == 24 * W
    assert check.silence_ms >= FIRST_CHECK_MS
    assert ep.waiting and ep.feed([0.0] * 5) == []  # audio waits for the answer
    end = ep.verdict(0.95)
    assert len(end) == 1 and isinstance(end[0], SpeechEnd)
    assert end[0].reason == "end_of_turn" and end[0].cause == "model" and end[0].end == 20 * W
    assert not ep.in_speech and not ep.waiting


def test_a_not_yet_speculates_at_the_pause_and_waits():
    ep = endpointer()
    evs = ep.feed([0.9] * 20 + [0.0] * 10)
    assert [type(e) for e in evs] == [SpeechStart, SpeechCheck]
    assert ep.verdict(0.1) == [SpeechPause(0, 20 * W)]  # the rest of the audio read: the pause at 224 ms


def test_a_thinking_pause_does_not_end_the_turn():
    ep = endpointer("medium")
    evs = ep.feed([0.9] * 20 + [0.0] * 40)  # 1.28 s pause
    assert isinstance(evs[-1], SpeechCheck)
    evs = ep.verdict(0.05)  # incomplete: the rest of the pause is read, asking again
    while evs and isinstance(evs[-1], SpeechCheck):
        evs = ep.verdict(0.05)
    assert not any(isinstance(e, SpeechEnd) for e in evs)
    assert ep.in_speech
    assert ep.feed([0.9] * 10) == [SpeechResume(60 * W)]


def test_incomplete_all_the_way_ends_at_the_cap():
    ep = endpointer("high")
    cap_windows = EAGERNESS["high"].cap_ms // WIN_MS + 2
    evs = ep.feed([0.9] * 20 + [0.0] * cap_windows)
    asks = 0
    while evs and isinstance(evs[-1], SpeechCheck):
        asks += 1
        evs = ep.verdict(0.0)
    ends = [e for e in evs if isinstance(e, SpeechEnd)]
    assert len(ends) == 1 and ends[0].reason == "silence" and ends[0].cause == "cap"
    assert asks == 1  # asked once per silence


def test_a_busy_model_ends_the_turn_at_the_silence_rule():
    ep = endpointer()
    evs = ep.feed([0.9] * 20 + [0.0] * 20)
    assert isinstance(evs[-1], SpeechCheck)
    evs = ep.verdict(None)
    ends = [e for e in evs if isinstance(e, SpeechEnd)]
    assert len(ends) == 1 and ends[0].cause == "fallback"


def test_speech_after_a_wait_starts_the_checks_over():
    ep = endpointer()
    ep.feed([0.9] * 20 + [0.0] * 4)
    assert ep.verdict(0.1) == []
    ep.feed([0.9] * 10)
    evs = ep.feed([0.0] * 4)  # a new silence: asked again from its start
    assert isinstance(evs[-1], SpeechCheck) and evs[-1].end == 34 * W


def test_verdict_without_a_check_is_an_error():
    with pytest.raises(RuntimeError):
        endpointer().verdict(0.5)


def test_without_a_policy_nothing_changes():
    ep = Endpointer(TurnConfig(early_end_ms=200, end_silence_ms=500))
    evs = ep.feed([0.9] * 20 + [0.0] * 20)
    assert [type(e) for e in evs] == [SpeechStart, SpeechPause, SpeechEnd]
    assert evs[-1].cause == "silence"


def test_end_of_input_while_waiting_ends_the_turn():
    ep = endpointer()
    ep.feed([0.9] * 20 + [0.0] * 4)
    assert ep.waiting
    end = ep.finish()
    assert end is not None and end.reason == "input_end" and not ep.waiting


def test_realtime_semantic_vad_chooses_the_model_and_its_eagerness():
    from pipeline.config import VoxpipeConfig
    from server.realtime.config import read_update, session_object
    from server.realtime.types import RealtimeError, Settings

    s = read_update({"turn_detection": {"type": "semantic_vad", "eagerness": "low"}}, Settings())
    assert (s.server_vad, s.end_of_turn, s.eagerness) == (True, "smart-turn", "low")
    td = session_object(s, VoxpipeConfig(), "x", "p")["audio"]["input"]["turn_detection"]
    assert td["type"] == "semantic_vad" and td["eagerness"] == "low"
    s = read_update({"turn_detection": {"type": "server_vad"}}, s)
    assert (s.end_of_turn, s.eagerness) == ("silence", None)
    assert session_object(s, VoxpipeConfig(), "x", "p")["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    with pytest.raises(RealtimeError):
        read_update({"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}, Settings())
    # null (as the openai package may send it) and absent mean OpenAI's default, auto
    for td in ({"type": "semantic_vad", "eagerness": None}, {"type": "semantic_vad"}):
        assert read_update({"turn_detection": td}, Settings()).eagerness == "auto"
