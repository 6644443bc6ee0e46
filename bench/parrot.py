"""The parrot rate: how often a reply merely repeats what the user said (issue 16, item 3).

Definition (the issue's "replies whose first 12 words are ≥ 60 % the user's own words in
order", made exact here):

1. Words: the text lowercased (Unicode NFKC first), split into maximal runs of letters and
   digits, an apostrophe between two of them staying inside the word (``I'm`` is one word,
   ``don't`` too); every other character (punctuation, quotes, dashes) separates words.
2. ``head``: the reply's first :data:`HEAD_WORDS` (12) words, or all of them if it has fewer.
3. ``overlap``: the length of the longest common subsequence of ``head`` and the user's words
   (words equal after step 1, kept in order but not necessarily adjacent), divided by
   ``len(head)``. An empty reply has overlap 0 (it is counted as empty, not as a parrot).
4. The reply parrots when ``overlap >= THRESHOLD`` (0.6).

So "Captain Freer says the scenery is delightful, you say?" parrots "Captain Freer says
that the scenery is delightful." (7 of its first 9 words, in order, = 0.78), while
"That sounds lovely. Where did he travel?" does not (0 of 7).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

HEAD_WORDS = 12
"""Words of the reply that are compared (issue 16)."""
THRESHOLD = 0.6
"""Overlap at or above which a reply parrots (issue 16)."""

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def words(text: str) -> list[str]:
    """Lowercased words of ``text`` (step 1 of the module's definition); ``’`` counts as ``'``."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).replace("\u2019", "'").lower())


def lcs_len(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (O(len(a)·len(b)) dynamic
    programming, one row of memory)."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        diag = 0
        for j, y in enumerate(b, 1):
            diag, row[j] = row[j], diag + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def overlap(user: str, reply: str, head_words: int = HEAD_WORDS) -> float:
    """Fraction in [0, 1] of the reply's first ``head_words`` words that are the user's words
    in order (step 3); 0.0 for a reply without words."""
    head = words(reply)[:head_words]
    return lcs_len(head, words(user)) / len(head) if head else 0.0


def parrots(user: str, reply: str, threshold: float = THRESHOLD) -> bool:
    """Whether ``reply`` parrots ``user`` (overlap ≥ ``threshold``, step 4)."""
    return overlap(user, reply) >= threshold


def parrot_rate(pairs: Sequence[tuple[str, str]]) -> float:
    """Fraction of ``(user, reply)`` pairs whose reply parrots; 0.0 for no pairs."""
    return sum(parrots(u, r) for u, r in pairs) / len(pairs) if pairs else 0.0
