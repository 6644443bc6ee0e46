"""The backchannel rule (pipeline/session/backchannel.py) and the barge-in decisions
(pipeline/session/barge_in.py): pure, no session, times given by the test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.config import TurnConfig
from pipeline.session.backchannel import BACKCHANNELS, Backchannels, words
from pipeline.session.barge_in import BargeIn
from pipeline.session.types import BargeAction as A

RULE = Backchannels.from_config(TurnConfig())


@pytest.mark.parametrize("text", ["Mm-hmm.", "Uh-huh.", "Okay.", "Yeah.", "Yeah, yeah.", "mhm", "MM HMM", "Mmm-hmm!",
                                  "I see.", "Got it.", "All right.", "Alright.", "Right.", "Sure.", "Oh, okay.",
                                  " yep ", "Okay...", "Yeahhh"])
def test_whisper_spellings_of_english_backchannels(text):
    assert RULE.is_backchannel(text, 500, "en")
    assert RULE.heard(text, 500, "en") == "backchannel"


@pytest.mark.parametrize(("text", "language"), [("Ja, genau.", "de"), ("D’accord.", "fr"), ("Ouais.", "fr"),
                                                ("Sí, claro.", "es"), ("Vale.", "es"), ("Va bene.", "it"),
                                                ("Tá bom.", "pt"), ("Oké, precies.", "nl"), ("Klopt.", "nl")])
def test_other_languages(text, language):
    assert RULE.is_backchannel(text, 500, language)
    assert RULE.is_backchannel(text, 500, None)  # an unknown language: every list counts


@pytest.mark.parametrize("text", ["No, stop.", "Yeah, but wait.", "Okay 2", "Go forward ten meters.",
                                  "What about Tuesday?", "Stop."])
def test_words_are_not_a_backchannel(text):
    assert not RULE.is_backchannel(text, 500, "en")
    assert RULE.heard(text, 500, "en") == "words"


def test_no_words():
    for text in ("", "  ", "...", "—"):
        assert RULE.heard(text, 300) == "nothing"
        assert not RULE.is_backchannel(text, 300)


def test_duration_and_word_count_limits():
    assert RULE.is_backchannel("yeah yeah yeah", 1000)  # 3 words, 1000 ms: the defaults' limits
    assert not RULE.is_backchannel("yeah yeah yeah yeah", 1000)
    assert not RULE.is_backchannel("yeah", 1001)
    tight = Backchannels.from_config(TurnConfig(backchannel_max_words=1, backchannel_max_ms=300))
    assert tight.is_backchannel("Okay.", 300) and not tight.is_backchannel("Oh, okay.", 300)
    assert not tight.is_backchannel("Okay.", 301)


def test_extra_words():
    rule = Backchannels.from_config(TurnConfig(backchannel_words="roger, copy that ,  "))
    assert rule.is_backchannel("Roger.", 400, "en") and rule.is_backchannel("Copy that.", 400, "de")
    assert not RULE.is_backchannel("Roger.", 400, "en")


def test_normalized_words():
    assert words("Mmm-hmm!") == ["mhm"] and words("Uh-huh.") == ["uhuh"] and words("D'accord") == ["dacord"]
    assert words("Sí, ¿vale?") == ["si", "vale"]


_ALL = sorted({p for entries in BACKCHANNELS.values() for p in entries if len(words(p)) == 1})
_STYLE = st.sampled_from([str.lower, str.upper, str.title, str.capitalize])
_PUNCT = st.sampled_from(["", ".", ",", "!", "?", "...", " -"])


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.sampled_from(_ALL), min_size=1, max_size=3), style=_STYLE, punct=_PUNCT,
       ms=st.floats(0, 1000))
def test_any_short_run_of_listed_words_is_a_backchannel(picks, style, punct, ms):
    text = " ".join(style(w) + punct for w in picks)
    assert RULE.is_backchannel(text, ms)


@settings(max_examples=300, deadline=None)
@given(picks=st.lists(st.sampled_from(_ALL), min_size=0, max_size=2), pos=st.integers(0, 2),
       intruder=st.sampled_from(["stop", "wait", "no", "tuesday", "table", "but", "meters", "7"]),
       ms=st.floats(0, 1000))
def test_one_other_word_makes_it_words(picks, pos, intruder, ms):
    ws = list(picks)
    ws.insert(min(pos, len(ws)), intruder)
    assert RULE.heard(" ".join(ws), ms) == "words"


@settings(max_examples=200, deadline=None)
@given(picks=st.lists(st.sampled_from(_ALL), min_size=1, max_size=6), ms=st.floats(0, 5000))
def test_limits_hold_for_any_text(picks, ms):
    text = " ".join(picks)
    if RULE.is_backchannel(text, ms):
        assert ms <= 1000 and 0 < len(words(text)) <= 3


# ---- the barge-in decisions --------------------------------------------------------------


def policy(**turn) -> BargeIn:
    cfg = TurnConfig(**turn)
    return BargeIn(cfg, Backchannels.from_config(cfg) if cfg.backchannels else None)


def test_today_off_never_pauses_and_any_words_cancel():
    p = policy(backchannels=False, resume_after_ms=0)
    assert not p.on
    assert p.speech_started(0, replying=True, audible=True) is A.NONE
    assert p.partial("Yeah.", 300) is A.NONE  # shorter than barge_in_min_ms
    assert p.partial("Yeah.", 500) is A.CANCEL
    assert p.final("Yeah.", 500) == ("words", A.NONE)


def test_backchannel_pauses_then_resumes_at_the_final():
    p = policy()
    assert p.speech_started(0, replying=True, audible=True) is A.PAUSE
    assert p.partial("Yeah.", 600) is A.NONE
    assert p.speech_ended(submitted=True) is A.NONE  # the final decides
    assert p.final("Yeah.", 400) == ("backchannel", A.RESUME)
    assert not p.paused


def test_words_cancel_a_paused_reply():
    p = policy()
    p.speech_started(0, replying=True, audible=True)
    assert p.partial("Yeah, but", 700) is A.CANCEL
    assert not p.paused and p.due(5000) is A.NONE


def test_a_short_no_cancels_at_the_final():
    p = policy()
    p.speech_started(0, replying=True, audible=True)
    p.speech_ended(submitted=True)
    assert p.final("No.", 300) == ("words", A.CANCEL)


def test_long_speech_is_never_a_backchannel():
    p = policy()
    p.speech_started(0, replying=True, audible=True)
    assert p.partial("Yeah.", 1200) is A.CANCEL


def test_a_late_partial_of_a_short_yeah_is_still_a_backchannel():
    # ASR partials come about once a second: the one that hears a 450 ms "yeah" may come when
    # 1.6 s passed since the speech began. Its voiced length decides, not the time since.
    late = policy()
    late.speech_started(0, replying=True, audible=True)
    assert late.partial("Yeah.", 1600, voiced_ms=450) is A.NONE and late.paused
    assert late.heard == "backchannel"
    talk = policy()
    talk.speech_started(0, replying=True, audible=True)
    assert talk.partial("Yeah.", 1600, voiced_ms=1300) is A.CANCEL  # a long "yeah" is talk


def test_the_timer_resumes_without_words_even_while_speech_goes_on():
    p = policy(resume_after_ms=1000)
    p.speech_started(100, replying=True, audible=True)
    assert p.due(1099) is A.NONE
    assert p.due(1100) is A.RESUME
    assert p.due(2000) is A.NONE  # once
    assert p.partial("Go forward ten meters.", 1500) is A.CANCEL  # words still cancel after the resume


def test_the_timer_waits_for_words_that_will_cancel():
    p = policy()
    p.speech_started(0, replying=True, audible=True)
    p.partial("No", 300)  # words, shorter than barge_in_min_ms
    assert p.due(1000) is A.NONE and p.paused


def test_refused_speech_resumes_at_its_end():
    p = policy()
    p.speech_started(0, replying=True, audible=True)
    assert p.speech_ended(submitted=False) is A.RESUME


def test_a_final_while_new_speech_goes_on_leaves_the_pause_to_it():
    p = policy()
    p.speech_started(0, replying=True, audible=True)
    p.speech_ended(submitted=True)
    assert p.speech_started(800, replying=True, audible=True) is A.NONE  # paused already
    assert p.final("Mm-hmm.", 400) == ("backchannel", A.NONE)
    assert p.paused


def test_not_audible_or_resume_off_never_pauses():
    assert policy().speech_started(0, replying=True, audible=False) is A.NONE
    p = policy(resume_after_ms=0)
    assert p.on and p.speech_started(0, replying=True, audible=True) is A.NONE
    assert p.partial("Okay.", 600) is A.NONE  # a backchannel does not cancel
    assert p.partial("Okay, stop.", 900) is A.CANCEL


def test_speech_over_no_reply_is_no_candidate():
    p = policy()
    assert p.speech_started(0, replying=False, audible=False) is A.NONE
    assert p.partial("Stop right there.", 2000) is A.NONE
