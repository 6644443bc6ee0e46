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
    """Accumulate text deltas; emit complete sentences as soon as they end.

    A sentence ends at ``.``, ``!``, ``?``, ``…`` or a newline followed by whitespace,
    except after a known abbreviation (``Dr.``, ``e.g.``) or inside a number
    (``3.14``), because the following character must be whitespace. Phrases shorter
    than ``min_chars`` are joined to the next one.
    """

    _END = re.compile(r"([.!?…]+[\"')\]]*\s+|\n+)")

    def __init__(self, *, min_chars: int = 12) -> None:
        self.min_chars = min_chars
        self._buf = ""

    def push(self, delta: str) -> list[str]:
        """Add a delta; return the phrases it completes (raw text, not yet cleaned)."""
        self._buf += delta
        out: list[str] = []
        start = 0
        for m in self._END.finditer(self._buf):
            candidate = self._buf[start : m.end()]
            if self._is_abbreviation(self._buf[: m.start() + 1]) or len(candidate.strip()) < self.min_chars:
                continue
            out.append(candidate.strip())
            start = m.end()
        self._buf = self._buf[start:]
        return out

    def flush(self) -> list[str]:
        """End of the reply: return what is left."""
        rest, self._buf = self._buf.strip(), ""
        return [rest] if rest else []

    @staticmethod
    def _is_abbreviation(text_to_dot: str) -> bool:
        if not text_to_dot.endswith("."):
            return False
        word = re.split(r"\s", text_to_dot[:-1])[-1].lower().lstrip("(\"'")
        return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())
