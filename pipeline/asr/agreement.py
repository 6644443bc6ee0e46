"""LocalAgreement-2: commit the words two consecutive hypotheses agree on.

The policy of whisper_streaming (Macháček, Dabre and Bojar, "Turning Whisper into
Real-Time Transcription System", IJCNLP-AACL 2023 demo;
https://github.com/ufal/whisper_streaming, ``HypothesisBuffer`` in ``whisper_online.py``):
re-decode the growing audio buffer, and commit the longest common prefix of the last
two hypotheses. Committed words are final; the rest is the unstable tail.

voxpipe forces the committed words that are still inside the audio buffer as the
decoder's prefix, so every hypothesis is already the continuation after the committed
text: whisper_streaming's time-based de-duplication of re-decoded committed words is
not needed. Words are compared case- and punctuation-insensitively; the newer
hypothesis supplies the committed spelling.

A pure synchronous class with no I/O, tested with scripted word lists.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_UNSPACED = re.compile(
    r"[\u0e00-\u0e7f\u0e80-\u0eff\u1000-\u109f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f]"
)
"""Scripts written without spaces (Thai, Lao, Myanmar, kana, CJK): one unit per character."""
_UNIT = re.compile(_UNSPACED.pattern + r"[^\s\w]*|[^\s]+?(?=" + _UNSPACED.pattern + r")|\S+")


@dataclass(slots=True, frozen=True)
class Word:
    """One unit of a transcript.

    Attributes:
        text: the unit as decoded (with attached punctuation, no surrounding spaces).
        space: True when a space precedes it in running text (False inside CJK text;
            a first unit counts as following earlier text).
    """

    text: str
    space: bool = True

    @property
    def key(self) -> str:
        """The comparison key: case-folded, punctuation and accents kept out."""
        return _key(self.text)


def _key(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    return "".join(ch for ch in text if ch.isalnum() or ch == "'").strip("'")


def word_spans(text: str) -> list[tuple[Word, int, int]]:
    """Units of ``text`` with their character spans: (word, start, end)."""
    out = []
    for m in _UNIT.finditer(text):
        if m.start() == 0:  # the first unit follows earlier text: spaced unless CJK/Thai
            space = not _UNSPACED.match(m.group())
        else:
            space = text[m.start() - 1].isspace()
        out.append((Word(m.group(), space), m.start(), m.end()))
    return out


def split_words(text: str) -> list[Word]:
    """Split decoded text into :class:`Word` units (space-separated words, or single
    characters of CJK/Thai scripts). A leading unit that is punctuation only (the
    decoder continuing a committed word with ``,``) is dropped."""
    words = [w for w, _, _ in word_spans(text)]
    if words and not words[0].key:
        words.pop(0)
    return words


def join_words(words: list[Word]) -> str:
    """Running text of ``words`` (the inverse of :func:`split_words`)."""
    out: list[str] = []
    for w in words:
        if out and w.space:
            out.append(" ")
        out.append(w.text)
    return "".join(out)


class LocalAgreement:
    """Commit the longest common prefix of consecutive hypotheses (LocalAgreement-2).

    Every hypothesis passed in is the continuation after :attr:`committed` (the
    decoder is forced through the committed words). Nothing committed is ever retracted.
    """

    def __init__(self) -> None:
        self.committed: list[Word] = []
        self.tail: list[Word] = []
        self._has_previous = False

    def insert(self, hypothesis: list[Word]) -> list[Word]:
        """Take a new hypothesis; return the words it commits (maybe none).

        The first hypothesis after a start or a :meth:`flush` commits nothing: there is
        nothing yet to agree with.
        """
        n = 0
        if self._has_previous:
            while n < min(len(hypothesis), len(self.tail)) and hypothesis[n].key == self.tail[n].key:
                n += 1
            while n > 0 and not hypothesis[n - 1].key:
                n -= 1  # never end a commit on a punctuation-only unit
        commit = hypothesis[:n]
        self.committed.extend(commit)
        self.tail = hypothesis[n:]
        self._has_previous = True
        return commit

    def flush(self, hypothesis: list[Word]) -> list[Word]:
        """End of the turn: commit the whole final hypothesis; return it."""
        commit = [w for w in hypothesis if w.key]
        self.committed.extend(commit)
        self.tail = []
        self._has_previous = False
        return commit

    def force(self, n: int) -> list[Word]:
        """Commit the first ``n`` words of the current tail without agreement (used
        when the audio buffer must be cut); return them."""
        commit, self.tail = self.tail[:n], self.tail[n:]
        self.committed.extend(commit)
        return commit

    def reset_tail(self) -> None:
        """Forget the unstable tail (its audio is gone); the next hypothesis starts afresh."""
        self.tail = []
        self._has_previous = False

    @property
    def committed_text(self) -> str:
        return join_words(self.committed)

    @property
    def tail_text(self) -> str:
        return join_words(self.tail)
