"""The reply's own echo (pipeline/session/echo_guard.py): words heard over a reply that are
the words it was playing neither cancel it nor continue or make a turn. The rule pure (with
Hypothesis), then a session on fake stages (tests/fakes.py): no models, waits with deadlines."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeline import metrics
from pipeline.config import TurnConfig, VoxpipeConfig
from pipeline.session import events as ev
from pipeline.session.backchannel import words
from pipeline.session.echo_guard import ECHO_MIN_WORDS, is_echo
from tests.fakes import FakeAsr, FakeLlm, FakeTts, LlmReply, fake_engines, silence, tone
from tests.session_harness import Audio, AudioOut, Harness, Start, Text, WaitFor

ANSWER = "Once upon a time there was a lighthouse keeper, and that's the story of the sea."  # ~6 s of fake speech
ECHO = tuple(ANSWER.split()[:6])  # the fake ASR hears these words, in order, one per 256 ms of speech


def test_the_reply_s_words_back_are_echo():
    assert is_echo("Once upon a time", ANSWER)
    assert is_echo("that's the story", "And that's the story.")  # punctuation and case do not matter
    assert is_echo("once upon the time there", ANSWER)  # one word misheard in five


def test_the_user_s_own_words_are_not():
    assert not is_echo("Tuesday", "It is on Tuesday.")  # one word is always the user's
    assert not is_echo("no, stop, I meant Tuesday", "We meet on Tuesday at noon.")
    assert not is_echo("time a upon once", ANSWER)  # the words, not in the order played
    assert not is_echo("once upon a time", "")  # nothing was playing
    # a person over a faint echo sent with their voice: mostly the reply's words, but three of
    # theirs in a row (bench echo at -35 dB; 14 of 18 words matched, 0.78, near the 0.8)
    reply = "I'm sure you're right. " * 6
    heard = "I'm sure you're right. I'm sure you can do the country. I'm sure you're right. I'm sure you're right."
    assert not is_echo(heard, reply)
    assert not is_echo("I'm sure you're right, so my fellow Americans", reply)
    assert is_echo("I'm sure your right. I'm sure you're right.", reply)  # misheard a word at a time


@given(st.lists(st.sampled_from(words(ANSWER)), min_size=1, max_size=12), st.data())
def test_a_stretch_of_what_played_is_echo_and_as_many_new_words_make_it_not(played, data):
    i = data.draw(st.integers(0, max(0, len(played) - ECHO_MIN_WORDS)))
    n = data.draw(st.integers(ECHO_MIN_WORDS, max(ECHO_MIN_WORDS, len(played) - i)))
    heard = played[i : i + n]
    text = " ".join(played)
    assert is_echo(" ".join(heard), text) == (len(heard) >= ECHO_MIN_WORDS)
    fresh = [f"zq{k}" for k in range(len(heard))]  # words the reply never said
    assert not is_echo(" ".join(heard + fresh), text)


# ---- a session over fakes ------------------------------------------------------------------


def harness(vocab: tuple[str, ...]) -> tuple[Harness, FakeLlm]:
    llm = FakeLlm([LlmReply.of(ANSWER)] * 3)
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig()
    engines = fake_engines(asr=FakeAsr(vocab=vocab), llm=llm, tts=FakeTts(s_per_char=0.08))
    return Harness(engines=engines, cfg=cfg), llm


def of(seen, kind) -> list:
    return [e for e in seen if isinstance(e, kind)]


async def test_the_reply_s_echo_neither_cancels_it_nor_makes_a_turn():
    h, llm = harness(ECHO)
    ignored = metrics.ECHO_IGNORED._value.get()
    try:
        seen = await h.play([Start(), Text("Tell me a story."), WaitFor(AudioOut),
                             Audio(tone(1500)), Audio(silence(700)), WaitFor(ev.TurnEmpty), WaitFor(ev.ResponseDone)])
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["echo"]
        assert not of(seen, ev.ResponseCancelled) and not of(seen, ev.TranscriptFinal)
        assert len(llm.requests) == 1 and metrics.ECHO_IGNORED._value.get() == ignored + 1
        await h.play([Text("And then?"), WaitFor(ev.ResponseDone, 2)])
        users = [m["content"] for m in llm.requests[1].messages if m["role"] == "user"]
        assert users[-2:] == ["Tell me a story.", "And then?"]  # the echo is not in the history
    finally:
        await h.close()


async def test_the_echo_does_not_continue_the_user_s_spoken_turn():
    # the failure a user met: speech in the merge window over the reply was its echo, and was
    # appended to the user's own turn (the reply cut: "you went on")
    h, llm = harness(ECHO)
    try:
        seen = await h.play([Start(), Audio(tone(1000)), Audio(silence(700)), WaitFor(AudioOut),
                             Audio(tone(1500)), Audio(silence(700)), WaitFor(ev.TurnEmpty), WaitFor(ev.ResponseDone)])
        assert [e.reason for e in of(seen, ev.TurnEmpty)] == ["echo"]
        assert not of(seen, ev.ResponseCancelled)
        assert len(of(seen, ev.TranscriptFinal)) == 1 and len(llm.requests) == 1
    finally:
        await h.close()


async def test_the_same_words_out_of_order_still_cancel_the_reply():
    h, _ = harness(tuple(reversed(ECHO)))  # "time a upon Once": the reply's words, not its echo
    try:
        seen = await h.play([Start(), Text("Tell me a story."), WaitFor(AudioOut),
                             Audio(tone(1500)), WaitFor(ev.ResponseCancelled)])
        assert [c.reason for c in of(seen, ev.ResponseCancelled)] == ["barge_in"]
    finally:
        await h.close()
