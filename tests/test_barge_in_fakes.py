"""Speech over a reply on fake stages (tests/fakes.py): backchannels do not cancel, a false
interruption pauses and resumes, words cancel; the switches give the old behaviour. No
models; waits have deadlines; no assertion depends on wall-clock speed."""

from __future__ import annotations

import asyncio

import pytest

from pipeline import metrics
from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.session import events as ev
from tests.fakes import Delta, FakeAsr, FakeLlm, FakeTts, LlmReply, fake_engines, noise, silence, tone
from tests.session_harness import Audio, AudioOut, Harness, Start, Text, WaitFor, types_of

ANSWER = "An answer that plays for a few seconds."  # 39 characters: ~3 s of fake speech
YEAH = ("Yeah.",)


def cfg(**turn) -> VoxpipeConfig:
    c = VoxpipeConfig()
    c.turn = TurnConfig(**turn)
    return c


def of(seen, kind) -> list:
    return [e for e in seen if isinstance(e, kind)]


def harness(*, vocab=None, turn=None, replies=2) -> tuple[Harness, FakeLlm]:
    llm = FakeLlm([LlmReply.of(ANSWER)] * replies)
    tts = FakeTts(s_per_char=0.08)
    engines = fake_engines(asr=FakeAsr(vocab=vocab), llm=llm, tts=tts)
    return Harness(engines=engines, cfg=cfg(**(turn or {}))), llm


# a typed question, then (once its reply is audible) speech over it
SPEAKING = [Start(), Text("Tell me something."), WaitFor(AudioOut)]


def count(counter, *labels) -> float:
    return (counter.labels(*labels) if labels else counter)._value.get()


async def test_a_backchannel_pauses_the_reply_which_resumes_and_completes():
    h, llm = harness(vocab=YEAH)
    ignored, resumed = count(metrics.BACKCHANNELS_IGNORED), count(metrics.FALSE_INTERRUPTIONS)
    try:
        seen = await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.TurnEmpty),
                             WaitFor(ev.ResponseDone)])
        t = types_of(seen)
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["backchannel"]
        assert not of(seen, ev.ResponseCancelled) and not of(seen, ev.TranscriptFinal)
        assert t.index("speech.started") < t.index("response.paused") < t.index("response.resumed") \
            < t.index("response.done")
        paused, resumed_ev = of(seen, ev.ResponsePaused)[0], of(seen, ev.ResponseResumed)[0]
        assert paused.response_id == resumed_ev.response_id == of(seen, ev.ResponseDone)[0].response_id
        assert paused.reason == "speech" and resumed_ev.paused_ms >= 0
        i, j = seen.index(paused), seen.index(resumed_ev)
        assert not [e for e in seen[i:j] if isinstance(e, AudioOut)], "audio sent while paused"
        assert len(llm.requests) == 1  # the backchannel got no reply of its own
        assert count(metrics.BACKCHANNELS_IGNORED) == ignored + 1
        assert count(metrics.FALSE_INTERRUPTIONS) == resumed + 1
        # the reply completed: the history keeps the acknowledgement after it
        await h.play([Text("And then?"), WaitFor(ev.ResponseDone, 2)])
        msgs = llm.requests[1].messages
        assert msgs[-4:] == [{"role": "user", "content": "Tell me something."},
                             {"role": "assistant", "content": ANSWER},
                             {"role": "user", "content": "Yeah."}, {"role": "user", "content": "And then?"}]
    finally:
        await h.close()


# a reply whose audio is all sent (within the 1 s playback lead) before it is heard
SHORT = "Sure, that works."  # 17 characters: ~1.4 s of fake speech


def short_harness(*, vocab=None) -> tuple[Harness, FakeLlm]:
    llm = FakeLlm([LlmReply.of(SHORT)] * 3)
    return Harness(engines=fake_engines(asr=FakeAsr(vocab=vocab), llm=llm, tts=FakeTts(s_per_char=0.08)),
                   cfg=cfg()), llm


async def test_a_backchannel_while_a_sent_reply_still_plays_is_still_a_backchannel():
    # response.done came (all audio sent), the client still plays its last second: "yeah"
    # then is an acknowledgement, not a new turn (before: a transcript and a second reply)
    h, llm = short_harness(vocab=YEAH)
    try:
        seen = await h.play([Start(), Text("Tell me something."), WaitFor(ev.ResponseDone), Audio(tone(300)),
                             Audio(silence(700)), WaitFor(ev.TurnEmpty)])
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["backchannel"]
        assert not of(seen, ev.TranscriptFinal) and len(llm.requests) == 1
        await h.play([Text("And then?"), WaitFor(ev.ResponseDone, 2)])
        assert llm.requests[1].messages[-3:] == [{"role": "assistant", "content": SHORT},
                                                 {"role": "user", "content": "Yeah."},
                                                 {"role": "user", "content": "And then?"}]
    finally:
        await h.close()


async def test_a_backchannel_in_the_merge_window_of_a_sent_reply_does_not_continue_the_turn():
    # the same, right after a spoken turn: "yeah" would have continued that turn at once
    # and had it answered again
    h, llm = short_harness(vocab=YEAH)
    try:
        seen = await h.play([Start(), Audio(tone(1000)), Audio(silence(700)), WaitFor(ev.ResponseDone),
                             Audio(tone(300)), Audio(silence(700)), WaitFor(ev.TurnEmpty)])
        ids = [e.turn_id for e in of(seen, ev.SpeechStarted)]
        assert ids == [ids[0], ids[0] + 1]
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["backchannel"]
        assert len(of(seen, ev.TranscriptFinal)) == 1 and len(llm.requests) == 1
    finally:
        await h.close()


async def test_speech_after_a_sent_reply_was_heard_out_is_a_turn_again():
    h, llm = short_harness(vocab=YEAH)
    try:
        await h.play([Start(), Text("Tell me something."), WaitFor(ev.ResponseDone)])
        await asyncio.sleep(1.5)  # its last audio is played by now (lead 1 s)
        seen = await h.play([Audio(tone(300)), Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        assert [e.text for e in of(seen, ev.TranscriptFinal)] == ["Yeah."] and not of(seen, ev.TurnEmpty)
        assert not of(seen, ev.ResponseCancelled)  # nothing left to cut
    finally:
        await h.close()


async def test_words_over_a_sent_reply_still_playing_cut_it_after_its_done():
    # the reply is all sent (a 60 s lead) and done while its client plays 16 s of it: words
    # then cut it after all (response.cancelled after response.done), which the client obeys.
    # Before, the server could no longer cancel it and a barge-in in a reply's last seconds
    # left it playing to its end.
    long_reply = "A long answer that goes on and on. " * 6  # 210 characters: ~17 s of fake speech
    llm = FakeLlm([LlmReply.of(long_reply), LlmReply.of(SHORT)])
    c = cfg()
    c.tts.playback_lead_s = 60.0
    h = Harness(engines=fake_engines(asr=FakeAsr(), llm=llm, tts=FakeTts(s_per_char=0.08)), cfg=c)
    try:
        seen = await h.play([Start(), Text("Tell me something."), WaitFor(ev.ResponseDone), Audio(tone(1500)),
                             WaitFor(ev.ResponseCancelled), Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        done = of(seen, ev.ResponseDone)[0]
        cancelled = of(seen, ev.ResponseCancelled)
        assert [(c.response_id, c.reason) for c in cancelled] == [(1, "barge_in")]
        assert seen.index(cancelled[0]) > seen.index(done)
        assert cancelled[0].spoken_text == long_reply.strip()  # all of it was sent
        assert of(seen, ev.ResponseStarted)[1].user_text == of(seen, ev.TranscriptFinal)[0].text
    finally:
        await h.close()


async def test_words_decided_after_the_reply_was_all_sent_still_cut_it():
    # speech begins over a reply still being sent; the reply's audio is all sent (done) while
    # the speech goes on, and only then does a partial hear words: they still cut it (before,
    # the reply's end ended the barge-in candidate, and the client played the rest)
    llm = FakeLlm([LlmReply([Delta("A first phrase that plays. ", 0.0),
                             Delta("And then a second phrase that goes on for a while. " * 4, 3.0)]),
                   LlmReply.of(SHORT)])
    c = cfg(resume_after_ms=0)
    c.tts.playback_lead_s = 60.0
    h = Harness(engines=fake_engines(asr=FakeAsr(), llm=llm, tts=FakeTts(s_per_char=0.08)), cfg=c)
    try:
        seen = await h.play([Start(), Text("Tell me something."), WaitFor(AudioOut), Audio(tone(300)),
                             WaitFor(ev.SpeechStarted), WaitFor(ev.ResponseDone), Audio(tone(1500)),
                             WaitFor(ev.ResponseCancelled)])
        t = types_of(seen)
        assert t.index("speech.started") < t.index("response.done") < t.index("response.cancelled")
        assert not of(seen, ev.SpeechStopped)  # one speech, over the reply from its start
        assert [(c.response_id, c.reason) for c in of(seen, ev.ResponseCancelled)] == [(1, "barge_in")]
    finally:
        await h.close()


async def test_a_wordless_burst_pauses_and_the_reply_resumes():
    h, llm = harness()
    try:
        seen = await h.play([*SPEAKING, Audio(noise(600)), Audio(silence(700)), WaitFor(ev.TurnEmpty),
                             WaitFor(ev.ResponseDone)])
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["no_words"]
        assert len(of(seen, ev.ResponsePaused)) == len(of(seen, ev.ResponseResumed)) == 1
        assert not of(seen, ev.ResponseCancelled) and llm.aborted == []
    finally:
        await h.close()


async def test_noise_that_goes_on_resumes_after_resume_after_ms():
    h, _ = harness(turn={"resume_after_ms": 100})
    try:
        # real-time noise for 1.5 s: the reply resumes while the "speech" still goes on
        seen = await h.play([*SPEAKING, Audio(noise(1500), pace=1.0), Audio(silence(700)), WaitFor(ev.ResponseDone)])
        t = types_of(seen)
        assert t.index("response.paused") < t.index("response.resumed") < t.index("speech.stopped")
        assert not of(seen, ev.ResponseCancelled)
    finally:
        await h.close()


async def test_words_cancel_a_paused_reply():
    h, llm = harness()
    outcome = count(metrics.BARGE_INS, "cancelled")
    try:
        seen = await h.play([*SPEAKING, Audio(tone(1500)), WaitFor(ev.ResponseCancelled)])
        t = types_of(seen)
        assert t.index("response.paused") < t.index("response.cancelled")
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["barge_in"]
        assert not of(seen, ev.ResponseResumed) and llm.aborted == [0]
        assert count(metrics.BARGE_INS, "cancelled") == outcome + 1
        seen = await h.play([Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])  # the words get their reply
        assert of(seen, ev.ResponseStarted)[1].user_text == of(seen, ev.TranscriptFinal)[0].text
    finally:
        await h.close()


async def test_a_short_word_without_partials_cancels_at_its_final():
    h, _ = harness(vocab=("Stop.",))
    try:
        seen = await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["barge_in"]
        assert of(seen, ev.ResponseStarted)[1].user_text == "Stop."
        assert not of(seen, ev.ResponseResumed)
    finally:
        await h.close()


async def test_backchannels_without_resume_do_not_cancel_nor_pause():
    h, llm = harness(vocab=YEAH, turn={"resume_after_ms": 0})
    try:
        seen = await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.TurnEmpty),
                             WaitFor(ev.ResponseDone)])
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["backchannel"]
        assert not of(seen, ev.ResponsePaused) and not of(seen, ev.ResponseCancelled)
        assert len(llm.requests) == 1
    finally:
        await h.close()


async def test_resume_without_backchannels_a_yeah_is_words():
    h, _ = harness(vocab=YEAH, turn={"backchannels": False})
    try:
        seen = await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        assert len(of(seen, ev.ResponsePaused)) == 1
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["barge_in"]
        assert of(seen, ev.ResponseStarted)[1].user_text == "Yeah."
    finally:
        await h.close()


async def test_switched_off_a_yeah_is_a_new_turn_as_before():
    h, _ = harness(vocab=YEAH, turn={"backchannels": False, "resume_after_ms": 0})
    try:
        seen = await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        assert not of(seen, ev.ResponsePaused) and not of(seen, ev.ResponseResumed)
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["new_turn"]
    finally:
        await h.close()


# ---- speech in the merge window over an audible reply ------------------------------------

SPOKEN = [Start(), Audio(tone(1000)), Audio(silence(700)), WaitFor(AudioOut)]


async def test_a_burst_in_the_merge_window_does_not_continue_the_turn():
    h, llm = harness()
    try:
        seen = await h.play([*SPOKEN, Audio(noise(600)), Audio(silence(700)), WaitFor(ev.TurnEmpty),
                             WaitFor(ev.ResponseDone)])
        ids = [e.turn_id for e in of(seen, ev.SpeechStarted)]
        assert ids == [ids[0], ids[0] + 1]  # a candidate turn of its own, not the first continued
        assert not of(seen, ev.ResponseCancelled) and llm.aborted == []
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["no_words"]
    finally:
        await h.close()


async def test_words_in_the_merge_window_continue_the_turn():
    h, llm = harness()
    try:
        seen = await h.play([*SPOKEN, Audio(tone(1500)), WaitFor(ev.ResponseCancelled), Audio(silence(700)),
                             WaitFor(ev.ResponseStarted, 2)])
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["continued"]
        first, merged = of(seen, ev.TranscriptFinal)
        second_id = of(seen, ev.SpeechStarted)[1].turn_id
        assert merged.turn_id == second_id == first.turn_id + 1
        assert (first.continues_turn_id, merged.continues_turn_id) == (None, first.turn_id)
        assert merged.text.startswith(first.text) and len(merged.text.split()) > len(first.text.split())
        assert of(seen, ev.ResponseStarted)[1].user_text == merged.text
    finally:
        await h.close()


async def test_words_that_end_before_a_partial_decides_continue_the_turn_at_their_final():
    # no partial may decide (barge_in_min_ms beyond the speech), as on a slow machine where
    # the speech ends before its first partial: the final transcript decides instead
    h, llm = harness(turn={"barge_in_min_ms": 5000})
    try:
        seen = await h.play([*SPOKEN, Audio(tone(1500)), Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["continued"]
        first, merged = of(seen, ev.TranscriptFinal)
        assert merged.turn_id == of(seen, ev.SpeechStarted)[1].turn_id == first.turn_id + 1
        assert (first.continues_turn_id, merged.continues_turn_id) == (None, first.turn_id)  # the join's sign
        assert merged.text.startswith(first.text) and len(merged.text.split()) > len(first.text.split())
        assert of(seen, ev.ResponseStarted)[1].user_text == merged.text
        users = [m["content"] for m in llm.requests[-1].messages if m["role"] == "user"]
        assert users[-1] == merged.text  # one turn: the whole utterance
        assert not of(seen, ev.TurnEmpty)
    finally:
        await h.close()


async def test_words_held_past_their_reply_s_end_still_continue_the_turn():
    # the reply's audio is all sent at once (a client buffering 5 s) and its LLM stream ends
    # while the held words go on, as when a user pauses mid-sentence: the reply is over on
    # the server, but the words still continue the turn (CI: JFK's "... ask what you can do
    # for your country" was answered as a turn of its own)
    llm = FakeLlm([LlmReply([Delta("Sure, that works. \U0001F600", 0.0), Delta("", 1.0)]), LlmReply.of(ANSWER)])
    c = cfg(barge_in_min_ms=5000)
    c.tts.playback_lead_s = 5.0
    h = Harness(engines=fake_engines(asr=FakeAsr(), llm=llm, tts=FakeTts(s_per_char=0.08)), cfg=c)
    try:
        seen = await h.play([*SPOKEN, Audio(tone(400)), WaitFor(ev.ResponseDone), Audio(tone(1100)),
                             Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        t = types_of(seen)
        assert t.index("response.started") < t.index("speech.started", t.index("response.started")) \
            < t.index("response.done")  # the words began over the running reply
        first, merged = of(seen, ev.TranscriptFinal)
        assert merged.turn_id == of(seen, ev.SpeechStarted)[1].turn_id == first.turn_id + 1
        assert (first.continues_turn_id, merged.continues_turn_id) == (None, first.turn_id)  # the join's sign
        # the whole utterance's words: the first speech's and the held words'
        assert len(merged.text.split()) >= len(first.text.split()) + len(FakeAsr.words(tone(1500))), merged.text
        # the reply it continued was all sent, but its client still plays it (5 s lead): cut
        # after its response.done, so that the client stops the answer to half a sentence
        cancelled = of(seen, ev.ResponseCancelled)
        assert [(c.response_id, c.reason) for c in cancelled] == [(1, "continued")]
        assert seen.index(cancelled[0]) > seen.index(of(seen, ev.ResponseDone)[0])
        assert of(seen, ev.ResponseStarted)[1].user_text == merged.text
    finally:
        await h.close()


async def test_switched_off_the_merge_window_continues_at_once_as_before():
    h, _ = harness(turn={"backchannels": False, "resume_after_ms": 0})
    try:
        seen = await h.play([*SPOKEN, Audio(noise(600)), WaitFor(ev.ResponseCancelled)])
        ids = [e.turn_id for e in of(seen, ev.SpeechStarted)]
        assert ids[0] == ids[1]
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["continued"]
    finally:
        await h.close()


@pytest.mark.parametrize("turn", [{}, {"resume_after_ms": 0}])
async def test_a_cancelled_reply_keeps_no_acknowledgement(turn):
    # a backchannel, then words that cancel the reply: the history has no "Yeah." of it
    h, llm = harness(vocab=("Yeah.", "Tuesday"), turn=turn)
    try:
        await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.TurnEmpty)])
        await h.play([Audio(silence(2500)), Audio(tone(1500)), WaitFor(ev.ResponseCancelled),
                      Audio(silence(700)), WaitFor(ev.ResponseStarted, 2)])
        contents = [m["content"] for m in llm.requests[-1].messages]
        assert "Tell me something." in contents and "Yeah." not in contents
    finally:
        await h.close()


async def test_the_realtime_edge_sends_nothing_for_a_pause():
    import json

    from server.realtime.outbox import RealtimeOutbox
    from server.realtime.types import Settings

    out = RealtimeOutbox(None, Settings(), maxsize=16, timeout_s=1.0)
    await out.send(ev.ResponsePaused(response_id=1, reason="speech"))
    await out.send(ev.ResponseResumed(response_id=1, paused_ms=700))
    assert out._q.empty()  # Realtime has no such events
    await out.send(ev.TurnEmpty(turn_id=1, reason="backchannel"))  # its transcription item completes, empty
    sent = json.loads(out._q.get_nowait())
    assert sent["type"] == "conversation.item.input_audio_transcription.completed" and sent["transcript"] == ""


async def test_a_backchannel_and_a_closed_session_leave_no_turn_pending_for_admission():
    """A backchannel's turn ends while the earlier reply still plays: it was admitted (its
    reply never ran), so it must stop counting; counted, four such turns filled the queue
    limit and later turns were refused as busy. A session closed mid-reply leaves nothing."""
    import time

    from pipeline.serving.admission import Admission

    c = cfg()
    admission = Admission(c.admission)
    engines = fake_engines(asr=FakeAsr(vocab=YEAH), llm=FakeLlm([LlmReply.of(ANSWER)] * 2),
                           tts=FakeTts(s_per_char=0.08))
    h = Harness(engines=engines, cfg=c, admission=admission)
    try:
        await h.play([*SPEAKING, Audio(tone(300)), Audio(silence(700)), WaitFor(ev.TurnEmpty)])
        assert [e.reason for e in of(h.out.seen, ev.TurnEmpty)] == ["backchannel"]
        assert not of(h.out.seen, ev.ResponseDone)  # the reply still plays
        assert admission.pending(time.monotonic()) == 0
        assert admission.critical(time.monotonic()) == 0  # the reply's first audio is out
        await h.play([Text("And then?"), WaitFor(ev.ResponseStarted, 2)])
    finally:
        await h.close()
    assert admission.pending(time.monotonic()) == admission.critical(time.monotonic()) == 0
