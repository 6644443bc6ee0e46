"""Session behaviour on fake stages (tests/fakes.py): barge-in, speculation, pause-merge,
busy, empty replies, typed turns, response.cancel. No models; waits have deadlines; no
assertion depends on wall-clock speed."""

from __future__ import annotations

import pytest

from pipeline.config import LlmConfig, TurnConfig, VoxpipeConfig
from pipeline.errors import Busy
from pipeline.llm.types import PRIORITY_VOICE
from pipeline.session import events as ev
from pipeline.session.responder import EMPTY_REPLY
from pipeline.session.turn_state import Phase
from tests.fakes import FakeAsr, FakeLlm, FakeTts, LlmReply, fake_engines, noise, silence, tone
from tests.session_harness import (
    Audio,
    AudioOut,
    Cancel,
    Harness,
    InputEnd,
    Sleep,
    Start,
    Text,
    WaitFor,
    WaitUntil,
    run_session,
    types_of,
)


def cfg(**turn) -> VoxpipeConfig:
    c = VoxpipeConfig()
    c.turn = TurnConfig(**turn)
    return c


def texts(seen, kind=ev.ResponseTextDelta) -> str:
    return "".join(e.delta for e in seen if isinstance(e, kind))


def of(seen, kind) -> list:
    return [e for e in seen if isinstance(e, kind)]


async def test_turn_gets_transcript_and_one_reply():
    llm = FakeLlm([LlmReply.of("Hello ", "there.")])
    seen = await run_session([Start(), Audio(silence(300)), Audio(tone(1200)),
                              Audio(silence(800)), WaitFor(ev.ResponseDone)],
                             engines=fake_engines(llm=llm))
    t = types_of(seen)
    assert t[:2] == ["session.started", "speech.started"]
    assert abs(of(seen, ev.SpeechStarted)[0].audio_ms - 300) <= 32  # one VAD window
    final = of(seen, ev.TranscriptFinal)
    assert len(final) == 1 and final[0].text.split()[:2] == ["alpha", "bravo"]
    assert t.index("speech.stopped") < t.index("transcript.final") < t.index("response.started")
    assert texts(seen) == "Hello there."
    assert of(seen, ev.ResponseDone)[0].finish_reason == "stop"
    assert any(isinstance(e, AudioOut) for e in seen)
    assert llm.requests[0].messages[-1] == {"role": "user", "content": final[0].text}
    assert llm.requests[0].priority == PRIORITY_VOICE  # before text API requests for a batch slot


async def test_barge_in_with_words_cancels_the_reply():
    llm = FakeLlm([LlmReply.of("A long answer that keeps talking for a good while.")])
    tts = FakeTts(s_per_char=0.2)  # ~10 s of audio: still playing when the user talks
    h = Harness(engines=fake_engines(llm=llm, tts=tts))
    try:
        # past merge_window_ms (2 s) of audio after the turn, so the speech is a new turn
        await h.play([Start(), Audio(tone(1000)), Audio(silence(700)), WaitFor(AudioOut),
                      Audio(silence(2500)), Audio(tone(1200)), WaitFor(ev.ResponseCancelled)])
        cancelled = of(h.out.seen, ev.ResponseCancelled)
        assert [c.reason for c in cancelled] == ["barge_in"]
        assert not of(h.out.seen, ev.ResponseDone)
        assert llm.aborted == [0]
        assert h.session.turn_state.phase is Phase.USER_SPEAKING
    finally:
        await h.close()


async def test_wordless_burst_over_the_reply_leaves_it_alone():
    llm = FakeLlm([LlmReply.of("An answer that plays for a few seconds.")])
    tts = FakeTts(s_per_char=0.05)  # ~2 s of audio, sent at most 1 s ahead of playback
    seen = await run_session([Start(), Audio(tone(1000)), Audio(silence(700)), WaitFor(AudioOut),
                              Audio(silence(2500)), Audio(noise(900)), Audio(silence(700)), WaitFor(ev.TurnEmpty),
                              WaitFor(ev.ResponseDone)],
                             engines=fake_engines(llm=llm, tts=tts))
    assert not of(seen, ev.ResponseCancelled)
    assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["no_words"]
    assert len(of(seen, ev.SpeechStarted)) == 2  # the burst was speech to the VAD
    assert llm.aborted == []


async def test_speculation_dropped_when_speech_resumes_sends_nothing():
    llm = FakeLlm([LlmReply.of("SPECULATIVE."), LlmReply.of("The real answer.")])
    h = Harness(engines=fake_engines(llm=llm))
    try:
        # 300 ms of silence: past early_end_ms (200), short of end_silence_ms (500)
        await h.play([Start(), Audio(tone(1000)), Audio(silence(300)),
                      WaitUntil(lambda: len(llm.requests) == 1, "the speculative LLM request")])
        during = list(h.out.seen)
        await h.play([Sleep(0.05), Audio(tone(600)), Audio(silence(700)), WaitFor(ev.ResponseDone)])
        assert not [e for e in h.out.seen[len(during):h.out.seen.index(of(h.out.seen, ev.SpeechStopped)[0])]
                    if isinstance(e, ev.ResponseStarted | ev.ResponseTextDelta | ev.ResponseDone | AudioOut)]
        assert llm.aborted == [0]  # the speculative request was aborted
        assert "SPECULATIVE" not in texts(h.out.seen)
        assert len(of(h.out.seen, ev.ResponseStarted)) == 1
        assert texts(h.out.seen) == "The real answer."
        assert len(of(h.out.seen, ev.SpeechStopped)) == 1  # one turn
        assert llm.requests[1].messages[-1]["content"] == of(h.out.seen, ev.TranscriptFinal)[0].text
        # the discarded speculation left no history: system, the example exchanges, the turn
        assert len(llm.requests[1].messages) == 2 + 2 * len(LlmConfig().examples)
    finally:
        await h.close()


async def test_speculation_promoted_when_the_pause_ends_the_turn():
    llm = FakeLlm([LlmReply.of("Speculated ", "answer.")])
    h = Harness(engines=fake_engines(llm=llm))
    try:
        await h.play([Start(), Audio(tone(1000)), Audio(silence(300)),
                      WaitUntil(lambda: len(llm.requests) == 1, "the speculative LLM request")])
        assert not of(h.out.seen, ev.ResponseStarted)  # held back until the turn ends
        await h.play([Audio(silence(400)), WaitFor(ev.ResponseDone)])
        t = types_of(h.out.seen)
        assert t.index("speech.stopped") < t.index("transcript.final") < t.index("response.started")
        assert len(llm.requests) == 1 and llm.aborted == []  # the speculative reply was used
        assert texts(h.out.seen) == "Speculated answer."
        assert of(h.out.seen, ev.ResponseStarted)[0].user_text == of(h.out.seen, ev.TranscriptFinal)[0].text
    finally:
        await h.close()


async def test_speech_resuming_within_merge_window_continues_the_turn():
    # the first reply cannot end on its own (30 s): only the continuation may stop it, however slow the machine
    llm = FakeLlm([LlmReply.of("First half reply.", delay_s=30.0), LlmReply.of("Whole reply.")])
    # no speculation: the first half's reply starts at the end of the turn
    seen = await run_session([Start(), Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseStarted),
                              Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseDone)],
                             engines=fake_engines(llm=llm), cfg=cfg(early_end_ms=0))
    assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["continued"]
    finals = [f.text for f in of(seen, ev.TranscriptFinal)]
    assert len(finals) == 2 and finals[1].startswith(finals[0]) and len(finals[1]) > len(finals[0])
    done = of(seen, ev.ResponseDone)
    assert len(done) == 1 and done[0].text == "Whole reply."
    assert llm.requests[1].messages[-1]["content"] == finals[1]


async def test_speech_after_the_merge_window_is_a_new_turn():
    llm = FakeLlm([LlmReply.of("First reply."), LlmReply.of("Second reply.")])
    # the 2.5 s pause in real time: the client has played the first reply out by then (by
    # the wall clock; sent faster, the speech would be over its playing tail, and cut it)
    seen = await run_session([Start(), Audio(tone(800)), Audio(silence(600)), WaitFor(ev.ResponseDone),
                              Audio(silence(2500), pace=1.0), Audio(tone(800)), Audio(silence(600)),
                              WaitFor(ev.ResponseDone, count=2)],
                             engines=fake_engines(llm=llm), cfg=cfg(early_end_ms=0))
    assert not of(seen, ev.ResponseCancelled)
    finals = [f.text for f in of(seen, ev.TranscriptFinal)]
    assert len(finals) == 2 and finals[1] == finals[0]  # a fresh transcript, not a continuation
    examples = ["user", "assistant"] * len(LlmConfig().examples)
    assert [m["role"] for m in llm.requests[1].messages] == ["system", *examples, "user", "assistant", "user"]


async def test_llm_busy_reports_busy_and_the_session_goes_on():
    llm = FakeLlm([Busy("llm is busy"), LlmReply.of("Second try works.")])
    h = Harness(engines=fake_engines(llm=llm))
    try:
        await h.play([Start(), Text("first"), WaitFor(ev.Busy)])
        assert [(b.reason, b.retry_after_ms > 0) for b in of(h.out.seen, ev.Busy)] == [("stage", True)]
        assert not of(h.out.seen, ev.ResponseStarted)  # refused before response.started: nothing left open
        assert not of(h.out.seen, ev.Error)
        await h.play([Text("second"), WaitFor(ev.ResponseDone)])
        assert texts(h.out.seen) == "Second try works."
        assert h.session.turn_state.phase is not Phase.THINKING or h.session.replies.current is None
    finally:
        await h.close()


async def test_empty_llm_output_speaks_the_fallback_line():
    llm = FakeLlm([LlmReply.of("  ", "**")])
    seen = await run_session([Start(), Text("say nothing"), WaitFor(ev.ResponseDone)],
                             engines=fake_engines(llm=llm))
    done = of(seen, ev.ResponseDone)[0]
    assert done.fallback and done.text == EMPTY_REPLY
    assert any(isinstance(e, AudioOut) for e in seen)


async def test_typed_turn_gets_a_reply_without_speech_events():
    llm = FakeLlm([LlmReply.of("Typed ", "answer.")])
    seen = await run_session([Start(), Text("hello"), WaitFor(ev.ResponseDone)], engines=fake_engines(llm=llm))
    assert types_of(seen)[:2] == ["session.started", "response.started"]
    assert of(seen, ev.ResponseStarted)[0].user_text == "hello"
    assert not of(seen, ev.SpeechStarted) and not of(seen, ev.TranscriptFinal)
    assert texts(seen) == "Typed answer."


async def test_response_cancel_stops_the_reply():
    llm = FakeLlm([LlmReply.of("Slow ", "answer ", "that ", "never ", "ends.", delay_s=0.5)])
    seen = await run_session([Start(), Text("hello"), WaitFor(ev.ResponseTextDelta), Cancel(),
                              WaitFor(ev.ResponseCancelled)], engines=fake_engines(llm=llm))
    assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["client"]
    assert not of(seen, ev.ResponseDone)
    assert llm.aborted == [0]


async def test_input_end_without_speech_is_an_empty_turn():
    seen = await run_session([Start(), Audio(silence(500)), InputEnd(), WaitFor(ev.TurnEmpty)])
    assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["no_speech"]


async def test_vad_off_turn_ends_at_input_end():
    llm = FakeLlm([LlmReply.of("Push to talk.")])
    seen = await run_session([Start(vad=False), Audio(tone(1000)), Audio(silence(1000)), InputEnd(),
                              WaitFor(ev.ResponseDone)], engines=fake_engines(llm=llm))
    stopped = of(seen, ev.SpeechStopped)
    assert [s.reason for s in stopped] == ["input_end"]
    assert of(seen, ev.SpeechStarted)[0].audio_ms == 0


async def test_input_end_while_a_reply_runs_is_not_an_empty_turn():
    llm = FakeLlm([LlmReply.of("Busy ", "answering.", delay_s=0.2)])
    seen = await run_session([Start(), Text("hello"), WaitFor(ev.ResponseStarted), InputEnd(),
                              WaitFor(ev.ResponseDone)], engines=fake_engines(llm=llm))
    assert not of(seen, ev.TurnEmpty)


@pytest.mark.parametrize("asr_delay_s", [0.05, 0.3, 0.7])
async def test_speech_that_stops_and_resumes_around_every_threshold_never_breaks_the_transcript(asr_delay_s):
    """Pauses just under and over early_end_ms, end_silence_ms and the merge window, with a
    slow ASR, so that finals, speculations, partial updates and continuations overlap: no
    turn may fail (``asr_failed``/``reply_failed``) and the session must end every turn."""
    asr = FakeAsr(delay_s=asr_delay_s)
    pattern = [tone(700), silence(230), tone(600), silence(520), tone(500), silence(900), tone(650),
               silence(180), tone(400), silence(1500), tone(900), silence(700)]
    script = [Start()] + [Audio(chunk, pace=1.0) for chunk in pattern] + [WaitFor(ev.ResponseDone)]
    h = Harness(engines=fake_engines(asr=asr))
    try:
        await h.play(script)
        await h.play([Audio(silence(2500))])  # let every pending decode and reply settle
        errors = [(e.code, e.message) for e in of(h.out.seen, ev.Error)]
        assert errors == []
        assert of(h.out.seen, ev.TranscriptFinal)
    finally:
        await h.close()
