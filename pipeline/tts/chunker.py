"""Text → speakable phrases: split the LLM's delta stream at sentence ends, and clean
markdown and emoji out of each phrase before it reaches TTS.

Pure functions and a pure class; no I/O.
"""

from __future__ import annotations

import re
import unicodedata

_ABBREVIATIONS = {
    "mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "etc", "e.g", "i.e", "a.m", "p.m",
    "u.s", "no", "inc", "ltd", "co", "mt", "approx", "fig", "jan", "feb", "mar", "apr", "jun",
    "jul", "aug", "sep", "sept", "oct", "nov", "dec",
}

_FUNCTION_WORDS = {
    "a", "an", "the", "to", "of", "and", "or", "but", "in", "on", "at", "for", "with", "by", "from",
    "as", "is", "are", "was", "were", "be", "my", "your", "his", "her", "its", "our", "their", "this",
    "that", "if", "so", "than", "then", "not", "no", "very", "i", "you", "we", "it",
}
"""Words a first phrase does not end on (it would sound cut off mid-phrase)."""
_WORD = re.compile(r"\S+\s+")
_PLAIN_WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")

_MD_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_MD_CODE_FENCE = re.compile(r"```.*?(```|$)", re.S)
_MD_EMPH = re.compile(r"(\*{1,3}|_{2,3}|~~|`)")
_MD_LINE_PREFIX = re.compile(r"^\s*(#{1,6}\s+|[-*+•]\s+|\d+[.)]\s+|>\s*)", re.M)
_TABLE_RULE = re.compile(r"^\s*\|?\s*:?-{2,}.*$", re.M)
_SPACES = re.compile(r"\s+")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")


def speakable(text: str) -> str:
    """Return only the words of ``text`` for TTS: markdown, emoji and symbols that a
    voice would read out as noise are removed; "" if no letter or digit remains."""
    t = _MD_CODE_FENCE.sub(" ", text)
    t = _MD_LINK.sub(r"\1", t)
    t = _TABLE_RULE.sub(" ", t)
    t = _MD_LINE_PREFIX.sub("", t)
    t = _MD_EMPH.sub("", t)
    t = t.replace("|", ", ")
    t = "".join(ch for ch in t if not _is_symbol(ch))
    t = _SPACES.sub(" ", t)
    t = _SPACE_BEFORE_PUNCT.sub(r"\1", t).strip(" ,")
    return t if any(ch.isalnum() for ch in t) else ""


def _is_symbol(ch: str) -> bool:
    cat = unicodedata.category(ch)
    return cat in ("So", "Sk", "Cs", "Co", "Cn") or ch in "\u200d\ufe0f"


class SentenceChunker:
    """Turn a stream of LLM text deltas into speakable phrases, as early as is natural.

    Rules (all need the whitespace after the punctuation to have arrived, so numbers
    like ``3.14``, ``$19.99``, ``1,000``, ``9:30``, versions ``v1.2.3``, URLs and e-mail
    addresses are never split):

    - a sentence ends at ``.``, ``!``, ``?``, ``…`` (plus closing quotes/brackets) or a
      newline — except after a known abbreviation (``Dr.``, ``e.g.``, ``a.m.``) or a
      single initial;
    - a clause boundary (``,``, ``;``, ``:``) ends a phrase once it is at least
      ``clause_chars`` long (natural prosody needs some length);
    - first-phrase rule: the first phrase of a reply may end at a clause boundary once it
      is ``first_chars`` long, or, with no punctuation yet, after ``first_words`` words
      (at the first later word that is plain letters — no digits, abbreviation or
      function word like "the"/"of"), trading a little prosody for time-to-first-audio
      (each word waits for a few decode steps);
    - phrases shorter than ``min_chars`` are joined to the next one;
    - a fenced code block (```) is held until it closes, so it stays in one phrase
      (which :func:`speakable` then drops).
    """

    _SENTENCE = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+")
    _BOUNDARY = re.compile(r"[.!?…]+[\"')\]]*\s+|\n+|[,;:]\s+")

    def __init__(self, *, min_chars: int = 12, clause_chars: int = 48, first_chars: int = 18,
                 first_words: int = 5) -> None:
        self.min_chars, self.clause_chars, self.first_chars = min_chars, clause_chars, first_chars
        self.first_words = first_words  # 0 = no word rule
        self._buf = ""
        self._emitted = 0

    def push(self, delta: str) -> list[str]:
        """Add a delta; return the phrases it completes (raw text, not yet cleaned)."""
        self._buf += delta
        out: list[str] = []
        start = 0
        while (end := self._next_cut(start)) is not None:
            out.append(self._buf[start:end].strip())
            self._emitted += 1
            start = end
        self._buf = self._buf[start:]
        return out

    def _next_cut(self, start: int) -> int | None:
        """End index of the phrase that starts at ``start``, if it is complete."""
        cut = None
        for m in self._BOUNDARY.finditer(self._buf, start):
            phrase = self._buf[start : m.end()]
            if phrase.count("```") % 2:
                continue  # inside a code fence
            if self._cut_here(phrase, m, self._buf[: m.start() + 1]):
                cut = m.end()
                break
        if self._emitted == 0 and self.first_words:
            word_cut = self._word_cut(start, cut)
            if word_cut is not None:
                return word_cut
        return cut

    def _word_cut(self, start: int, limit: int | None) -> int | None:
        """First-phrase word rule: the end of the first plain word at or after word
        ``first_words`` (before ``limit``), once the next word has begun."""
        n = 0
        for m in _WORD.finditer(self._buf, start, len(self._buf) if limit is None else limit):
            word = m.group().strip()
            if "```" in word or self._buf[start : m.end()].count("```") % 2:
                return None
            if not any(ch.isalnum() for ch in word):
                continue
            n += 1
            if (n >= self.first_words and _PLAIN_WORD.fullmatch(word) and word.lower() not in _FUNCTION_WORDS
                    and word.lower() not in _ABBREVIATIONS and len(self._buf[start : m.end()].strip()) >= self.min_chars
                    and m.end() < len(self._buf)):
                return m.end()
        return None

    def flush(self) -> list[str]:
        """End of the reply: return what is left."""
        rest, self._buf = self._buf.strip(), ""
        return [rest] if rest else []

    def _cut_here(self, phrase: str, m: re.Match, upto_punct: str) -> bool:
        length = len(phrase.strip())
        if length < self.min_chars:
            return False
        if self._SENTENCE.fullmatch(m.group()):
            return not _is_abbreviation(upto_punct)
        limit = self.first_chars if self._emitted == 0 else self.clause_chars
        return length >= limit


def _is_abbreviation(text_to_dot: str) -> bool:
    if not text_to_dot.endswith("."):
        return False
    word = re.split(r"\s", text_to_dot[:-1])[-1].lower().lstrip("(\"'")
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())
