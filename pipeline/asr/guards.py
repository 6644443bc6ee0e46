"""Hallucination guards on Whisper output (pure functions, no model).

Whisper invents text on silence and noise ("you", "Thank you.", dot loops) and loops
on hesitant speech (tests/test_asr_stream.py, tests/test_asr_policy.py). The session
gates Whisper with Silero VAD;
these guards handle what still comes out: Whisper's own no-speech rule
(``no_speech_prob`` high *and* ``avg_logprob`` low, from openai/whisper
``transcribe.py``), the gzip compression ratio (long loops), text with no word
characters, and :func:`cut_repetition` for short loops that a ratio misses.
"""

from __future__ import annotations

import re
import zlib

from pipeline.asr.agreement import Word, join_words, split_words
from pipeline.config import AsrConfig

_WORD = re.compile(r"\w", re.UNICODE)
HARD_NO_SPEECH = 0.85
"""Above this no-speech probability text is dropped whatever its log-probability: on
tiny.en, silence decoded as ". . ." and "you" at 0.95–0.98 with log-probabilities
above −1, while no decode of the test speech that had words went above 0.62."""
STOCK_NO_SPEECH = 0.4
"""Above this no-speech probability the stock phrases below are taken as hallucinations,
and so is any text whose average log-probability is under ``log_prob_threshold``
(Whisper's own rule asks for 0.6: on −60 dBFS noise, base decoded short buffers as
"请问", "大陆》", "I'm sorry." at 0.50–0.60 with log-probabilities of −1.5 to −3.9,
while no decode of the test speech with a log-probability under −1 went above 0.28)."""
_STOCK_TEXTS = (
    "you", "Thank you.", "Thanks.", "Thank you very much.", "Thank you for watching!", "Thanks for watching!",
    "Bye.", "Music", "Music playing", "Subtitles by the Amara.org community", "我", "你",
    "字幕由Amara.org社区提供", "请不吝点赞 订阅 转发 打赏支持明镜与点点栏目",
)


def _phrase_key(text: str) -> str:
    return " ".join(w.key for w in split_words(text) if w.key)


STOCK_PHRASES = frozenset(_phrase_key(t) for t in _STOCK_TEXTS)
"""What Whisper says on silence and noise, normalised like :attr:`Word.key`."""


def compression_ratio(text: str) -> float:
    """len(utf-8) / len(zlib(utf-8)), as Whisper computes it (≥ 2.4 means a loop)."""
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


def repetition_mask(keys: list[str], *, max_repeats: int = 3, max_ngram: int = 8) -> list[bool]:
    """Which of the words (given by comparison ``keys``) to keep so that no n-gram
    (n ≤ ``max_ngram``) appears more than ``max_repeats`` times in a row; the words
    after a loop are kept."""
    idx = list(range(len(keys)))  # positions still kept, in order
    cur = list(keys)
    i = 0
    while i < len(idx):
        for n in range(1, max_ngram + 1):
            gram = cur[i : i + n]
            if len(gram) < n:
                break
            reps = 1
            while cur[i + reps * n : i + (reps + 1) * n] == gram:
                reps += 1
            if reps > max_repeats:
                cut = slice(i + max_repeats * n, i + reps * n)
                del idx[cut], cur[cut]
                break
        i += 1
    kept = set(idx)
    return [j in kept for j in range(len(keys))]


def cut_repetition(text: str, *, max_repeats: int = 3, max_ngram: int = 8) -> str:
    """Cut a runaway repetition loop: keep at most ``max_repeats`` consecutive copies of
    any n-gram (n ≤ ``max_ngram`` words, or characters of CJK text); the words after
    the loop are kept."""
    words = split_words(text)
    mask = repetition_mask([w.key for w in words], max_repeats=max_repeats, max_ngram=max_ngram)
    return join_words([w for w, k in zip(words, mask) if k])


def trailing_loop(keys: list[str], *, copies: int = 2, max_ngram: int = 8) -> tuple[int, int] | None:
    """The loop at the end of ``keys``: ``(start, n)`` such that ``keys[start:]`` is
    ``copies`` or more back-to-back copies of an n-gram (n ≤ ``max_ngram``; the last copy
    may be cut short), with the earliest end of the first copy (``start + n``); None when
    the words do not end in such a loop. ``keys[: start + n]`` keeps one copy."""
    best = None
    for n in range(1, min(max_ngram, len(keys) // copies) + 1):
        s = len(keys) - n  # keys[s:] repeats with period n
        while s > 0 and keys[s - 1] == keys[s - 1 + n]:
            s -= 1
        if len(keys) - s >= copies * n and (best is None or s + n < sum(best)):
            best = (s, n)
    return best


_SENTENCE_ENDS = (".", "?", "!", "。", "？", "！")


def restarted_tail(words: list[Word], *, min_n: int = 3, max_n: int = 8) -> int:
    """Words at the end of ``words`` that start the sentence just before them over:
    ``… U. U[:k]`` with U a sentence of ``min_n``..``max_n`` words and 1 ≤ k < len(U)
    → k (the largest such), else 0. Whisper does this at the end of a buffer that stops
    right after a sentence ("… scenery is delightful. Captain Freer"); a partial must
    not offer those words for commitment."""
    keys = [w.key for w in words]
    L = len(keys)
    for k in range(min(max_n - 1, L - min_n), 0, -1):
        for n in range(max(min_n, k + 1), min(max_n, L - k) + 1):
            unit = keys[L - k - n : L - k]
            if unit[:k] == keys[L - k :] and words[L - k - 1].text.rstrip("\"')»”").endswith(_SENTENCE_ENDS):
                return k
    return 0


def _echo_length(before: list[str], cont: list[str]) -> int:
    """Length of the longest head of ``cont`` that re-reads the end of ``before`` (Whisper
    starting over once the audio is used up): 3 words equal, or at least 4 words of
    which three quarters match position by position; 2 equal words when they are all of
    ``cont``."""
    for n in range(min(len(before), len(cont)), 1, -1):
        same = sum(a == b for a, b in zip(cont[:n], before[-n:]))
        if same == n and (n >= 3 or n == len(cont)):
            return n
        if n >= 4 and same >= 0.75 * n:
            return n
    return 0


def check_continuation(text: str, *, context: str, no_speech_prob: float, avg_logprob: float,
                       cfg: AsrConfig, partial: bool = False) -> tuple[str, str]:
    """Apply the guards to one decoded continuation.

    Args:
        text: what the decoder wrote after the committed words.
        context: the committed text just before it (loops and echoes start there).
        no_speech_prob, avg_logprob: from the decoder.
        cfg: thresholds (``no_speech_threshold``, ``log_prob_threshold``,
            ``compression_ratio_threshold``).
        partial: the decode of a buffer whose speech goes on. Whisper loops where such
            audio stops ("Go forward. Go forward. Go"), so a loop at the end of context +
            text keeps one copy (a final keeps up to three: people do say "bye bye").
    Returns:
        (kept text, reason) — reason is "" when nothing was removed, else
        ``no_speech``, ``no_words``, ``compression``, ``hallucination`` or ``repetition``.
    """
    text = text.strip()
    if not text:
        return "", ""
    if not _WORD.search(text):
        return "", "no_words"
    unsure = avg_logprob < cfg.log_prob_threshold
    if (unsure and no_speech_prob > min(cfg.no_speech_threshold, STOCK_NO_SPEECH)) or no_speech_prob > HARD_NO_SPEECH:
        return "", "no_speech"
    words = split_words(text)
    if no_speech_prob > STOCK_NO_SPEECH and _phrase_key(text) in STOCK_PHRASES:
        return "", "hallucination"
    if compression_ratio(text) > cfg.compression_ratio_threshold:
        return "", "compression"
    before = [w.key for w in split_words(context)[-24:]]
    keys = [w.key for w in words]
    echo = _echo_length(before, keys)
    mask = [False] * echo + repetition_mask(before + keys[echo:])[len(before) :]
    if partial:
        idx = [j for j, m in enumerate(mask) if m]  # words kept so far
        loop = trailing_loop(before + [keys[j] for j in idx])
        if loop is not None:  # the loop's first copy stays (it may be committed already)
            for j in idx[max(0, sum(loop) - len(before)) :]:
                mask[j] = False
        idx = [j for j, m in enumerate(mask) if m]
        k = restarted_tail(split_words(context)[-24:] + [words[j] for j in idx])
        for j in idx[len(idx) - min(k, len(idx)) :]:
            mask[j] = False
    if all(mask):
        return text, ""
    return join_words([w for w, k in zip(words, mask) if k]), "repetition"
