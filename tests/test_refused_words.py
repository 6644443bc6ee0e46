"""A turn refused by admission keeps its words (issue 37, item 3): its ``busy`` is followed by
its ``transcript.final`` (``unanswered``), decoded in the background or, while the ASR stage
is what is short, the words its partials committed; the history keeps it as an unanswered
user turn, which the next reply's prompt shows; speech that continues it takes both back.
Orchestration over scripted fakes (tests/fakes.py), plus the pure pieces."""

from __future__ import annotations

import numpy as np

from pipeline.asr.engine import AsrEngine
from pipeline.asr.types import DecodeRequest
from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.serving.admission import Admission
from pipeline.session import events as ev
from pipeline.session.history import ChatHistory
from tests.fakes import VOCAB, FakeAsr, FakeLlm, LlmReply, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, Start, WaitFor, WaitUntil


def of(seen, kind):
    return [e for e in seen if isinstance(e, kind)]


def _refusing(*, merge_window_ms: int = 300, asr: FakeAsr | None = None) -> tuple[FakeLlm, FakeAsr, Harness]:
    """A session whose turns admission refuses (the LLM's batch is full, a queue behind it)
    until the test lets the load pass (``llm.active = llm.depth = 0``)."""
    llm, asr = FakeLlm(default=LlmReply.of("Sure.")), asr or FakeAsr()
    llm.active, llm.slots, llm.depth = 8, 8, 16
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=0, merge_window_ms=merge_window_ms)
    return llm, asr, Harness(engines=fake_engines(llm=llm, asr=asr), cfg=cfg, admission=Admission(cfg.admission))


def _user_messages(llm: FakeLlm, i: int) -> list[str]:
    return [m["content"] for m in llm.requests[i].messages if m["role"] == "user"]


async def test_a_refused_turn_gets_its_transcript_final_decoded_in_the_background():
    llm, asr, h = _refusing()
    try:
        speech = tone(2000)
        seen = await h.play([Start(), Audio(speech), Audio(silence(700)), WaitFor(ev.TranscriptFinal)])
        busy, final = of(seen, ev.Busy)[0], of(seen, ev.TranscriptFinal)[0]
        assert seen.index(busy) < seen.index(final)  # busy first: the decision takes no model time
        assert final.turn_id == busy.turn_id and final.unanswered and final.source == "asr"
        assert final.text.split() == FakeAsr.words(speech), final.text
        assert final.audio_ms >= 2000
        # decoded at background priority: after every other decode
        finals = [r for r in asr.requests if isinstance(r, DecodeRequest) and r.final]
        assert finals and all(r.background for r in finals)
        assert not llm.requests and not of(seen, ev.ResponseStarted)
        assert h.session.history.turns == [(final.text, "")]
    finally:
        await h.close()


async def test_the_next_turn_prompt_has_the_refused_turn_as_a_user_message():
    llm, _, h = _refusing()
    try:
        first = tone(2000)
        seen = await h.play([Start(), Audio(first), Audio(silence(700)), WaitFor(ev.TranscriptFinal)])
        refused = of(seen, ev.TranscriptFinal)[0].text
        llm.active = llm.depth = 0  # the load passes; the user asks again, after the merge window
        seen = await h.play([Audio(silence(1500)), Audio(tone(1000)), Audio(silence(700)),
                             WaitFor(ev.ResponseDone)])
        answered = [e for e in of(seen, ev.TranscriptFinal) if not e.unanswered]
        assert len(answered) == 1 and answered[0].turn_id != of(seen, ev.Busy)[0].turn_id
        msgs = llm.requests[-1].messages
        # the refused turn's words, as a user message of its own, right before the new one
        assert msgs[-2:] == [{"role": "user", "content": refused}, {"role": "user", "content": answered[0].text}]
        await h.play([WaitUntil(lambda: len(h.session.history.turns) == 2, "the reply is recorded")])
        assert h.session.history.turns == [(refused, ""), (answered[0].text, "Sure.")]
    finally:
        await h.close()


async def test_while_the_asr_is_short_the_committed_words_are_told():
    asr = FakeAsr()
    llm, asr, h = _refusing(asr=asr)
    try:
        speech = tone(3000)
        seen = await h.play([Start(), Audio(speech, pace=4.0)])
        asr.urgent_depth = 3  # other turns' final decodes wait at the ASR: it is the stage short of time
        seen = await h.play([Audio(silence(700)), WaitFor(ev.Busy)])
        seen = await h.play([WaitFor(ev.TranscriptFinal)])
        partials = of(seen, ev.TranscriptPartial)
        final = of(seen, ev.TranscriptFinal)[0]
        assert final.unanswered and final.source == "partial"
        assert final.text and final.text == partials[-1].committed, (final.text, partials[-1])
        assert not [r for r in asr.requests if isinstance(r, DecodeRequest) and (r.final or r.background)]
        assert h.session.history.turns == [(final.text, "")]
    finally:
        await h.close()


async def test_speech_that_continues_a_refused_turn_supersedes_its_transcript():
    llm, _, h = _refusing(merge_window_ms=2000)
    try:
        first_half, second_half = tone(1500), tone(1000)
        seen = await h.play([Start(), Audio(first_half), Audio(silence(700)), WaitFor(ev.TranscriptFinal)])
        early = of(seen, ev.TranscriptFinal)[0]
        assert early.unanswered
        llm.active = llm.depth = 0  # the load passes while the user goes on speaking
        seen = await h.play([Audio(second_half), Audio(silence(700)), WaitFor(ev.ResponseDone)])
        final = of(seen, ev.TranscriptFinal)[-1]
        assert final.turn_id == early.turn_id and not final.unanswered and final.source == "asr"
        assert len(final.text.split()) > len(early.text.split())
        assert final.text.startswith(early.text)
        # the history has the merged turn once, not the refused part as well
        users = _user_messages(llm, 0)
        assert users[-1] == final.text and early.text not in users, users
        assert llm.requests[0].messages[-2]["role"] == "assistant"  # (the example exchanges' last)
    finally:
        await h.close()


async def test_a_continued_refused_turn_refused_again_keeps_the_whole_utterance():
    llm, _, h = _refusing(merge_window_ms=2000)
    try:
        seen = await h.play([Start(), Audio(tone(1500)), Audio(silence(700)), WaitFor(ev.TranscriptFinal),
                             Audio(tone(1000)), Audio(silence(700)), WaitFor(ev.TranscriptFinal, 2)])
        early, whole = of(seen, ev.TranscriptFinal)
        assert len(of(seen, ev.Busy)) == 2 and early.turn_id == whole.turn_id and whole.unanswered
        assert len(whole.text.split()) > len(early.text.split())
        assert h.session.history.turns == [(whole.text, "")]
    finally:
        await h.close()


# ---- the pure pieces ---------------------------------------------------------------------------


def test_history_keeps_an_unanswered_turn_revises_it_in_place_and_forgets_that_entry_only():
    h = ChatHistory("sys")
    h.add_turn("Hi.", "Hello!")
    same = h.add_unanswered("What")
    entry = h.add_unanswered("What")  # an equal one: forget drops this very entry
    assert h.messages("Next?")[-4:] == [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "What"},
                                        {"role": "user", "content": "What"}, {"role": "user", "content": "Next?"}]
    entry = h.revise(entry, "What time is it?")
    h.add_turn("Next?", "Noon.")
    assert h.turns == [("Hi.", "Hello!"), ("What", ""), ("What time is it?", ""), ("Next?", "Noon.")]
    h.forget(entry)
    assert h.turns == [("Hi.", "Hello!"), ("What", ""), ("Next?", "Noon.")]
    assert h.turns[1] is same
    h.forget(entry)  # no longer kept: nothing
    assert h.revise(entry, "x") is entry and len(h.turns) == 3


def test_an_unanswered_turn_with_no_words_yet_is_not_in_the_prompt():
    h = ChatHistory("sys")
    h.add_unanswered("")
    assert h.messages("Hi") == [{"role": "system", "content": "sys"}, {"role": "user", "content": "Hi"}]


def test_a_background_decode_goes_after_partials_and_finals():
    audio = np.zeros(1600, dtype=np.float32)
    ranks = [AsrEngine.priority(None, DecodeRequest(audio, **kw))  # type: ignore[arg-type]
             for kw in ({"final": True}, {"urgent": True}, {}, {"final": True, "background": True})]
    assert ranks == [0, 0, 1, 2]


def test_vocab_is_what_the_fake_hears():  # (the tests above compare texts with FakeAsr.words)
    assert FakeAsr.words(tone(1000))[0] == VOCAB[0]
