"""Streaming-ASR policies with scripted hypotheses: LocalAgreement-2, buffer trimming,
hallucination guards (no model)."""

from __future__ import annotations

import numpy as np

from audio.pcm import RATE
from pipeline.asr.agreement import LocalAgreement, join_words, split_words
from pipeline.asr.decode import _before_loop
from pipeline.asr.guards import check_continuation, cut_repetition, restarted_tail, trailing_loop
from pipeline.asr.stream import CATCHUP_WINDOW_S, StreamingTranscript
from pipeline.asr.types import DecodeResult, TimedWord
from pipeline.config import AsrConfig


def W(text: str):
    return split_words(text)


def test_commits_the_prefix_two_hypotheses_agree_on():
    la = LocalAgreement()
    assert la.insert(W("and so")) == []  # nothing to agree with yet
    assert join_words(la.insert(W("And so, my fellow"))) == "And so,"  # case/punctuation-insensitive
    assert la.tail_text == "my fellow"
    assert join_words(la.insert(W("my fellow Americans"))) == "my fellow"
    assert la.insert(W("Americans, ask not")) == W("Americans,")
    assert la.committed_text == "And so, my fellow Americans,"
    assert la.tail_text == "ask not"


def test_committed_words_are_never_retracted():
    la = LocalAgreement()
    la.insert(W("ask not what you are"))
    la.insert(W("ask not what your country"))
    committed = la.committed_text
    assert committed == "ask not what"
    for hyp in ("coming to", "your country can", "your country can do"):
        la.insert(W(hyp))
        assert la.committed_text.startswith(committed)
        committed = la.committed_text
    assert committed == "ask not what your country can"


def test_a_changed_hypothesis_commits_nothing_new():
    la = LocalAgreement()
    la.insert(W("the guttenberg"))
    assert la.insert(W("the gutenberg bible")) == W("the")
    assert la.insert(W("Gutenberg, or forty-two")) == W("Gutenberg,")


def test_flush_commits_the_rest_at_the_end_of_the_turn():
    la = LocalAgreement()
    la.insert(W("he was not"))
    la.insert(W("he was not an ill"))
    assert la.committed_text == "he was not"
    assert join_words(la.flush(W("an ill-disposed young man."))) == "an ill-disposed young man."
    assert la.committed_text == "he was not an ill-disposed young man." and la.tail == []
    assert la.insert(W("more")) == []  # a reopened turn starts agreeing afresh


def test_units_of_unspaced_scripts_are_characters():
    words = split_words("你好，世界 ok")
    assert [w.text for w in words] == ["你", "好，", "世", "界", "ok"]
    assert join_words(words) == "你好，世界 ok"
    la = LocalAgreement()
    la.insert(split_words("我们走"))
    assert join_words(la.insert(split_words("我们去"))) == "我们"


def test_leading_punctuation_of_a_continuation_is_dropped():
    assert [w.text for w in split_words(", ask not")] == ["ask", "not"]


def test_guards():
    cfg = AsrConfig()
    ok = dict(context="", no_speech_prob=0.1, avg_logprob=-0.3, cfg=cfg)
    assert check_continuation(" Hello there.", **ok) == ("Hello there.", "")
    assert check_continuation(" . . . .", **ok) == ("", "no_words")
    assert check_continuation("you", context="", no_speech_prob=0.9, avg_logprob=-1.5, cfg=cfg) == ("", "no_speech")
    assert check_continuation(" and then " * 20, **ok)[1] == "compression"
    text, why = check_continuation("the end the end go", **dict(ok, context="it was the end the end"))
    assert (text, why) == ("go", "repetition")  # the head re-reads the committed text
    echo = "Selbst ein großer Dinosaurier war ihm nicht gewachsen."
    assert check_continuation(echo, **dict(ok, context="was ins Wasser kam. " + echo)) == ("", "repetition")
    assert check_continuation("you", context="", no_speech_prob=0.7, avg_logprob=-0.5, cfg=cfg) == ("", "hallucination")
    assert check_continuation("Thank you.", **ok) == ("Thank you.", "")  # clearly spoken: kept
    assert check_continuation(" . . . . . .", context="", no_speech_prob=0.96, avg_logprob=-0.1, cfg=cfg)[0] == ""
    assert cut_repetition("i think i think i think i think i think so") == "i think i think i think so"


def test_low_confidence_text_on_likely_silence_is_dropped():
    cfg = AsrConfig()
    noise = dict(context="", no_speech_prob=0.53, avg_logprob=-3.1, cfg=cfg)  # base on −60 dBFS noise
    assert check_continuation("请问", **noise) == ("", "no_speech")
    assert check_continuation("I'm sorry.", **dict(noise, no_speech_prob=0.51, avg_logprob=-1.6)) == ("", "no_speech")
    speech = dict(context="", no_speech_prob=0.28, avg_logprob=-1.37, cfg=cfg)  # tiny.en, 1 s of speech
    assert check_continuation("when are you", **speech) == ("when are you", "")
    sure = dict(context="", no_speech_prob=0.55, avg_logprob=-0.8, cfg=cfg)
    assert check_continuation("And", **sure) == ("And", "")


def test_a_partial_keeps_one_copy_of_a_loop_at_its_end():
    cfg = AsrConfig()
    ok = dict(context="", no_speech_prob=0.1, avg_logprob=-0.3, cfg=cfg)
    loop = "Go forward. Go forward. Go forward. Go"
    assert check_continuation(loop, **ok, partial=True) == ("Go forward.", "repetition")
    assert check_continuation("Go forward. Go", **dict(ok, context="Go forward."), partial=True) == ("", "repetition")
    assert check_continuation("no no", **ok, partial=True) == ("no", "repetition")
    assert check_continuation("no no", **ok) == ("no no", "")  # a final keeps up to three copies
    assert check_continuation("ten meters", **dict(ok, context="go forward"), partial=True) == ("ten meters", "")
    assert trailing_loop("a b c".split()) is None
    assert trailing_loop("x a b a b a".split()) == (1, 2)


def test_a_runaway_keeps_the_words_before_its_loop():
    assert _before_loop(" of about 1455, 4555, 4555, 4555, 4555, 45") == "of about 1455, 4555,"
    assert _before_loop(" 小小小小小小小") == ""  # a loop from the start: noise
    assert _before_loop(" 小小小小小小小", sure=True) == ""  # even when the decoder is sure
    # Whisper repeating the sentence a buffer ends with: said once, kept once (when sure)
    rep = " Captain Freer says that the scenery is delightful." * 5 + " Captain"
    assert _before_loop(rep, sure=True) == "Captain Freer says that the scenery is delightful."
    assert _before_loop(rep) == ""
    # the loop began in the committed prefix: keep the words up to the end of its first copy
    cont = " says that the scenery is delightful Captain Freer" * 4 + " says"
    assert _before_loop(cont, sure=True, context="go forward 10 meters Captain Freer") == \
        "says that the scenery is delightful"
    assert _before_loop(" and it went on and on without any loop at al") == ""


# ---- StreamingTranscript with a scripted decoder -------------------------------------

class Script:
    """Plays the decoder: the words spoken in the buffer, with times. A ``flaky`` script
    changes every word it has not been forced to keep, so nothing is ever agreed on."""

    def __init__(self, words: list[tuple[str, float, float]], *, flaky: bool = False) -> None:
        self.words, self.flaky, self.calls = words, flaky, 0  # (word, start, end): stream time
        self.windows: list[float] = []  # audio of each request (s)
        self.offset = 0.0  # stream time of the buffer start

    def answer(self, st: StreamingTranscript, *, final: bool = False):
        self.calls += 1
        req = st.request(final=final)
        length = len(req.audio) / RATE
        self.windows.append(length)
        heard = [(w, a - self.offset, b - self.offset) for w, a, b in self.words
                 if a >= self.offset - 1e-6 and b - self.offset <= length]
        prefix = split_words(req.prefix)
        assert [p.key.split("v")[0] for p in prefix] == [w for w, _, _ in heard[: len(prefix)]]
        cont = [w + (f"v{self.calls}" if self.flaky else "") for w, _, _ in heard[len(prefix) :]]
        words = None
        if req.word_times:
            texts = [p.text for p in prefix] + cont
            words = [TimedWord(t, a, b) for t, (_, a, b) in zip(texts, heard)]
        before = st.trimmed_s
        part = st.apply(DecodeResult(" ".join(cont), "en", words, no_speech_prob=0.0 if heard else 0.9))
        self.offset += st.trimmed_s - before
        return part


def speech(n_words: int, *, rate: float = 3.0, sentence_every: int = 0):
    return [(f"w{i}", i / rate, i / rate + 0.8 / rate) for i in range(n_words)]


def stream(script: Script, seconds: float, cfg: AsrConfig):
    st = StreamingTranscript(cfg)
    partials, buffers = [], []
    for _ in range(int(seconds * 50)):
        st.feed(np.zeros(RATE // 50, np.float32))
        if st.due():
            partials.append(script.answer(st))
            buffers.append(st.buffer_s)
    return st, partials, buffers


def test_long_speech_keeps_the_buffer_bounded_and_loses_no_word():
    cfg = AsrConfig()
    words = speech(270)  # 90 s at 3 words/s, no pause longer than a word gap
    script = Script(words)
    st, partials, buffers = stream(script, 90.5, cfg)
    assert max(buffers) <= cfg.trim_s + 2 * cfg.min_chunk_ms / 1000
    assert st.trimmed_s > 70
    committed = [p.committed for p in partials]
    assert all(b.startswith(a) for a, b in zip(committed, committed[1:]))  # never retracted
    assert len(split_words(committed[-1])) >= 260  # commits keep up with the speech
    final = script.answer(st, final=True)
    assert final.final and final.unstable == ""
    assert final.text.split() == [w for w, _, _ in words]


def test_unagreed_speech_is_force_committed_at_max_buffer():
    cfg = AsrConfig(trim_s=4.0, max_buffer_s=8.0)
    st, partials, buffers = stream(Script(speech(90, rate=3.0), flaky=True), 30.0, cfg)
    assert max(buffers) <= cfg.max_buffer_s + 1.0
    assert len(st.agreement.committed) > 60
    keys = [w.key.split("v")[0] for w in st.agreement.committed]
    assert keys == [f"w{i}" for i in range(len(keys))]  # in order, none lost or repeated


def test_silence_is_dropped_from_the_buffer():
    cfg = AsrConfig(trim_s=4.0, max_buffer_s=8.0)
    st, partials, buffers = stream(Script([]), 40.0, cfg)
    assert max(buffers) <= cfg.trim_s + 1.0
    assert all(p.text == "" for p in partials) and st.agreement.committed == []


def test_a_burst_is_decoded_in_real_time_sized_windows_and_loses_no_word():
    """90 s of speech arriving at once (``ask --fast``): worked through in windows of
    about ``CATCHUP_WINDOW_S``, every word kept."""
    cfg = AsrConfig()
    words = speech(270)
    script = Script(words)
    st = StreamingTranscript(cfg)
    st.feed(np.zeros(int(90.5 * RATE), np.float32))
    assert st.due() and not st.fits_final()
    while not st.fits_final():
        script.answer(st)
    final = script.answer(st, final=True)
    assert final.text.split() == [w for w, _, _ in words]
    assert max(script.windows) <= cfg.max_buffer_s  # never Whisper's whole window
    assert np.median(script.windows) <= CATCHUP_WINDOW_S
    assert len(script.windows) < 90 / 4  # a few seconds of progress per decode


def test_unagreed_speech_in_a_burst_is_force_committed_and_kept():
    cfg = AsrConfig(trim_s=4.0, max_buffer_s=8.0)
    script = Script(speech(90, rate=3.0), flaky=True)
    st = StreamingTranscript(cfg)
    st.feed(np.zeros(30 * RATE, np.float32))
    while not st.fits_final():
        script.answer(st)
    script.answer(st, final=True)
    keys = [w.key.split("v")[0] for w in st.agreement.committed]
    assert keys == [f"w{i}" for i in range(90)]


def test_a_partial_does_not_offer_a_restarted_sentence():
    """Whisper starts the last sentence over where a buffer stops right after it."""
    cfg = AsrConfig()
    text = "Captain Freer says that the scenery is delightful. Captain Freer"
    kept, why = check_continuation(text, context="Go forward 10 meters.", no_speech_prob=0.05,
                                   avg_logprob=-0.3, cfg=cfg, partial=True)
    assert kept == "Captain Freer says that the scenery is delightful." and why == "repetition"
    # a final keeps what it heard; ordinary text is untouched
    assert check_continuation(text, context="", no_speech_prob=0.05, avg_logprob=-0.3, cfg=cfg)[0] == text
    assert restarted_tail(split_words("the cat and the")) == 0  # no sentence end before the tail
    assert restarted_tail(split_words("Go forward ten meters. Go forward")) == 2
    assert restarted_tail(split_words("Go forward ten meters. Stop")) == 0
