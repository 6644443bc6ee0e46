"""The reply in the user's language (issue 35): the instruction a turn's user message
carries (pipeline/session/language.py), the prompts a conversation builds with it, and a
session on fake stages whose ASR detects German. No models; waits have deadlines."""

from __future__ import annotations

from pipeline.config import VoxpipeConfig
from pipeline.session import events as ev
from pipeline.session.history import ChatHistory
from pipeline.session.language import language_name, reply_instruction, with_instruction
from tests.fakes import FakeAsr, FakeLlm, fake_engines, silence, tone
from tests.session_harness import Audio, Harness, Start, Text, WaitFor


def count(msgs: list[dict]) -> int:
    return sum(len(m["content"].split()) + 4 for m in msgs)


def test_other_languages_get_an_instruction_english_and_unknown_none():
    assert reply_instruction("de") == "Answer in German."
    assert reply_instruction("yue") == "Answer in Cantonese."
    assert reply_instruction("ht") == "Answer in Haitian Creole."
    assert reply_instruction("en") == reply_instruction(None) == reply_instruction("") == ""
    assert language_name("xx") == "xx" and language_name("DE") == "German"
    assert with_instruction("Wie spät ist es?", "de") == "Wie spät ist es?\n(Answer in German.)"
    assert with_instruction("What time is it?", "en") == "What time is it?"


def test_each_turn_follows_its_own_language_and_the_prompts_extend_each_other():
    """German, then English, then French: only the new user message changes; turn n+1's
    prompt starts with turn n's whole prompt and its reply (the prefix cache's best case)."""
    h = ChatHistory("sys", examples=[("Hi.", "Hello!")])
    prompts = []
    for text, lang, reply in (("Wie spät ist es?", "de", "Es ist drei Uhr."), ("And now?", "en", "Four."),
                              ("Et maintenant ?", "fr", "Cinq heures.")):
        msgs = h.prompt(with_instruction(text, lang), count, 1000)
        h.add_turn(msgs[-1]["content"], reply)
        prompts.append(msgs)
    assert [m["content"] for m in prompts[0][:3]] == ["sys", "Hi.", "Hello!"]
    assert prompts[0][-1]["content"].endswith("\n(Answer in German.)")
    assert prompts[1][-1]["content"] == "And now?"
    assert prompts[2][-1]["content"] == "Et maintenant ?\n(Answer in French.)"
    for before, after in zip(prompts, prompts[1:], strict=False):
        assert after[: len(before)] == before
        assert after[len(before)]["role"] == "assistant"


def test_a_long_turn_cut_to_the_budget_keeps_the_instruction():
    h = ChatHistory("sys")
    text = " ".join(["wort"] * 400)
    msgs = h.prompt(with_instruction(text, "de"), count, 100)
    assert count(msgs) <= 100 and msgs[-1]["content"].endswith("(Answer in German.)")


async def _spoken_turn(h: Harness, n: int) -> None:
    await h.play([Audio(silence(300)), Audio(tone(1200)), Audio(silence(800)),
                  WaitFor(ev.ResponseDone, count=n, timeout_s=20.0)])


async def test_a_session_answers_each_spoken_turn_in_its_detected_language():
    asr, llm = FakeAsr(language="de"), FakeLlm()
    h = Harness(engines=fake_engines(asr=asr, llm=llm))
    try:
        await h.play([Start()])
        await _spoken_turn(h, 1)
        asr.language = "en"  # the user switches to English
        await _spoken_turn(h, 2)
    finally:
        await h.close()
    finals = h.out.events(ev.TranscriptFinal)
    assert [f.language for f in finals] == ["de", "en"]
    first, second = (r.messages for r in llm.requests)
    assert first[-1]["content"] == f"{finals[0].text}\n(Answer in German.)"
    assert second[-1]["content"] == f"{finals[1].text}\n(Answer in English.)"  # switched back: said so
    assert second[: len(first)] == first  # the German turn is kept as sent
    assert [s.user_text for s in h.out.events(ev.ResponseStarted)] == [f.text for f in finals]


async def test_a_typed_turn_follows_the_sessions_fixed_language():
    llm = FakeLlm()
    h = Harness(engines=fake_engines(asr=FakeAsr(language="de"), llm=llm), cfg=VoxpipeConfig())
    try:
        await h.play([Start(language="de"), Text("Hallo"), WaitFor(ev.ResponseDone, timeout_s=20.0)])
    finally:
        await h.close()
    assert llm.requests[0].messages[-1]["content"] == "Hallo\n(Answer in German.)"
    assert not h.out.events(ev.Error)


async def test_english_sessions_prompts_are_unchanged():
    llm = FakeLlm()
    h = Harness(engines=fake_engines(llm=llm))
    try:
        await h.play([Start(), Text("hello"), WaitFor(ev.ResponseDone, timeout_s=20.0)])
        await _spoken_turn(h, 2)
    finally:
        await h.close()
    assert [r.messages[-1]["content"] for r in llm.requests] == ["hello", h.out.events(ev.TranscriptFinal)[0].text]


def test_the_first_english_turn_after_another_language_asks_for_english_then_nothing():
    earlier: list[str] = []
    for text, lang, expected in [("Hello.", "en", "Hello."),
                                 ("Wie spät ist es?", "de", "Wie spät ist es?\n(Answer in German.)"),
                                 ("Go forward.", "en", "Go forward.\n(Answer in English.)"),
                                 ("And then?", "en", "And then?"),
                                 ("Quelle heure?", "fr", "Quelle heure?\n(Answer in French.)"),
                                 ("Hmm.", None, "Hmm."),
                                 ("Stop.", "en", "Stop.\n(Answer in English.)")]:
        sent = with_instruction(text, lang, earlier)
        assert sent == expected, (text, sent)
        earlier.append(sent)
    assert reply_instruction("en", ["A (Answer in German.)"]) == ""  # not on its own line: the user's words
