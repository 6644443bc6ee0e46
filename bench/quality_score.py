"""How ``voxpipe bench quality`` scores a reply (issue 33): the rules, the LLM judge's rubric
and digit parser, and the judge's agreement with hand labels.

Rules (:func:`failed_rules`; the issue's list for a short spoken reply):

- ``empty``: the reply has no word (:func:`bench.parrot.words`);
- ``truncated``: generation hit ``max_new_tokens``, or the text does not end with terminal
  punctuation (``. ! ? …``, trailing quotes, brackets, emoji and other symbols ignored);
- ``sentences``: more than :data:`MAX_SENTENCES` sentences (:func:`count_sentences`);
- ``words``: more than :data:`MAX_WORDS` words;
- ``refusal``: a refusal or an "as an AI" disclaimer (:data:`REFUSALS`);
- ``parrot``: the reply parrots the user (:func:`bench.parrot.parrots`);
- ``question_only``: every sentence is a question (it asks back instead of answering).

A ``request`` must pass all of them; a ``talk`` turn (a statement, small talk, a command)
``empty``, ``sentences`` and ``parrot`` (:data:`CLASS_RULES`): asking back is a fine reaction
to a statement, and its length and tone are the judge's to weigh.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.parrot import parrots, words

MAX_SENTENCES = 2
"""Sentences a spoken reply may have (the server's system prompt asks for one or two)."""
MAX_WORDS = 40
"""Words a spoken reply may have (about 15 s of speech)."""
ALL_RULES = ("empty", "truncated", "sentences", "words", "refusal", "parrot", "question_only")
CLASS_RULES: dict[str, tuple[str, ...]] = {"request": ALL_RULES, "talk": ("empty", "sentences", "parrot")}
"""The rules each rule-scored class must pass."""

REFUSALS = re.compile(
    r"\bas an ai\b|\bas a (?:language model|virtual assistant|voice assistant)\b"
    r"|\bi(?:'m| am) (?:just )?an? (?:ai|language model|virtual assistant|computer program)\b"
    r"|\bi(?:'m| am) (?:not able|unable) to\b"
    r"|\bi (?:can't|cannot|can not|won't) (?:help|assist|provide|answer|do that|tell|give|share)\b"
    r"|\bi don't have (?:access|the ability|personal|real time|real-time|feelings)\b"
    r"|\bi(?:'m| am) sorry,? but i\b", re.IGNORECASE)
"""Refusal and disclaimer phrases (after ``’`` → ``'``)."""

_ABBREV = re.compile(r"\b(?:mr|mrs|ms|dr|st|vs|etc|e\.g|i\.e|a\.m|p\.m|no)\.", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?\u2026]+[\"'\u201d\u2019)\]]*(?=\s|$)")
_TERMINAL = ".!?\u2026"


def _clean(text: str) -> str:
    return unicodedata.normalize("NFKC", text).replace("\u2019", "'").strip()


def _strip_tail(text: str) -> str:
    """``text`` without trailing spaces, quotes, brackets, emoji and other symbols."""
    end = len(text)
    while end and (text[end - 1].isspace() or text[end - 1] in "\"')]*_\u201d\u2019"
                   or unicodedata.category(text[end - 1]) in ("So", "Sk", "Cf", "Mn")):
        end -= 1
    return text[:end]


def sentences(text: str) -> list[str]:
    """The sentences of ``text``: split after ``. ! ? …`` (and closing quotes) followed by a space
    or the end; a few abbreviations (``Mr.``, ``e.g.``, ``p.m.``) do not end a sentence, nor does a
    decimal point. Pieces without a word are dropped."""
    body = _ABBREV.sub(lambda m: m.group(0)[:-1], _clean(text))
    return [s.strip() for s in _SENTENCE_END.split(body) if words(s)]


def count_sentences(text: str) -> int:
    """How many sentences ``text`` has (:func:`sentences`); text without an end mark is one."""
    return len(sentences(text))


def is_truncated(text: str, finish_reason: str | None = None) -> bool:
    """Whether the reply was cut: ``finish_reason`` is ``length`` (hit ``max_new_tokens``) or the
    text (non-empty) ends without terminal punctuation (:func:`_strip_tail` first)."""
    if str(finish_reason) == "length":
        return True
    tail = _strip_tail(_clean(text))
    return bool(words(tail)) and tail[-1] not in _TERMINAL


def question_only(text: str) -> bool:
    """Whether every sentence of ``text`` is a question (False for text without words)."""
    parts = [p for p in re.split(r"(?<=[.!?\u2026])\s+", _clean(text)) if words(p)]
    return bool(parts) and all(_strip_tail(p).endswith("?") for p in parts)


def failed_rules(cls: str, user: str, reply: str, finish_reason: str | None = None) -> list[str]:
    """The rules of :data:`CLASS_RULES` ``[cls]`` that ``reply`` to ``user`` breaks, in
    :data:`ALL_RULES` order (empty: it passes; an empty reply fails ``empty`` only).

    Raises:
        KeyError: ``cls`` is not a rule-scored class.
    """
    wanted = CLASS_RULES[cls]
    if not words(reply):
        return ["empty"]
    checks = {
        "empty": False,
        "truncated": is_truncated(reply, finish_reason),
        "sentences": count_sentences(reply) > MAX_SENTENCES,
        "words": len(words(reply)) > MAX_WORDS,
        "refusal": bool(REFUSALS.search(_clean(reply))),
        "parrot": parrots(user, reply),
        "question_only": question_only(reply),
    }
    return [r for r in ALL_RULES if r in wanted and checks[r]]


# --- the judge --------------------------------------------------------------------------------

JUDGE_RUBRIC = (
    "You grade the replies of a voice assistant in a spoken conversation. You are shown what the "
    "user said and the assistant's reply. Score the reply from 1 to 5:\n"
    "5 = on point and natural: it answers or responds to exactly what the user said, correctly, in one "
    "or two short spoken sentences.\n"
    "4 = a good reply, but a little long, stiff or generic.\n"
    "3 = related, but vague, partly wrong, or too long to say aloud.\n"
    "2 = mostly misses the point, is wrong, repeats the user's words back, or is cut off.\n"
    "1 = off-topic, nonsense, empty, or a refusal.\n"
    "Answer with one digit only.")
"""The judge's system prompt (the issue's rubric: 5 = on point, natural, short spoken answer;
1 = off-topic, nonsense or empty)."""
JUDGE_MAX_NEW_TOKENS = 4
"""Tokens the judge may write (the digit comes first)."""

_DIGIT = re.compile(r"[1-5]")


def judge_messages(user: str, reply: str, history: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The judge's chat messages for one reply: the rubric, then the earlier exchanges (if any),
    the user's turn and the reply, asking for the score."""
    lines = []
    if history:
        lines.append("Earlier in the conversation:")
        for u, a in history:
            lines += [f"User: {u}", f"Assistant: {a}"]
        lines.append("")
    lines += [f'The user said: "{user}"', f'The assistant replied: "{reply.strip()}"', "", "Score (1-5):"]
    return [{"role": "system", "content": JUDGE_RUBRIC}, {"role": "user", "content": "\n".join(lines)}]


def parse_score(text: str) -> int | None:
    """The first digit 1-5 in the judge's output, or None when it wrote none."""
    m = _DIGIT.search(text)
    return int(m.group(0)) if m else None


# --- the judge's agreement with hand labels ---------------------------------------------------

LABELS_TSV = Path(__file__).with_name("quality_labels.tsv")
"""Hand labels: ``user<TAB>reply<TAB>label<TAB>reason`` after that header; ``#`` comments."""


@dataclass(frozen=True, slots=True)
class Label:
    """One hand-labelled reply: the ``user`` turn, the ``reply``, its ``label`` (1-5 by
    :data:`JUDGE_RUBRIC`) and the labeller's one-line ``reason``."""

    user: str
    reply: str
    label: int
    reason: str


def load_labels(path: Path = LABELS_TSV) -> list[Label]:
    """The hand labels of ``path``, in file order.

    Raises:
        ValueError: a line without four columns or a label that is not 1-5 (with its line number).
    """
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#") or line == "user\treply\tlabel\treason":
            continue
        cols = line.split("\t")
        if len(cols) != 4 or cols[2] not in {"1", "2", "3", "4", "5"}:
            raise ValueError(f"{path}:{n}: want 'user<TAB>reply<TAB>1-5<TAB>reason', got {line!r}")
        out.append(Label(cols[0], cols[1], int(cols[2]), cols[3]))
    return out


@dataclass(slots=True)
class Agreement:
    """The judge against hand labels: ``n`` pairs scored (unparsed judge outputs left out and
    counted in ``unparsed``), ``exact`` and ``within1`` agreement (fractions), Spearman's rank
    and Pearson's correlation (NaN when either side is constant or n < 2)."""

    n: int
    unparsed: int
    exact: float
    within1: float
    spearman: float
    pearson: float

    def line(self) -> str:
        """One line for the table's footer."""
        return (f"exact {self.exact:.0%}, within 1 {self.within1:.0%}, Spearman {self.spearman:.2f}, "
                f"Pearson {self.pearson:.2f} (n={self.n}{f', {self.unparsed} unparsed' if self.unparsed else ''})")

    def short(self) -> str:
        """The table cell: exact / within-1 agreement and Spearman's rho."""
        return f"{self.exact:.0%}/{self.within1:.0%} ρ{self.spearman:.2f}"


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's correlation of ``x`` and ``y``; NaN when either is constant or shorter than 2."""
    n = len(x)
    if n < 2 or n != len(y):
        return math.nan
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else math.nan


def ranks(x: Sequence[float]) -> list[float]:
    """1-based ranks of ``x``, ties given their mean rank (as Spearman's rho wants)."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    out = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation (Pearson's of the tie-averaged ranks); NaN as :func:`pearson`."""
    return pearson(ranks(x), ranks(y))


def agreement(labels: Sequence[int], scores: Sequence[int | None]) -> Agreement:
    """Agreement of the judge's ``scores`` with hand ``labels`` (pairs in order; a None score, an
    unparsed judge output, is left out). Correlations by scipy when it is installed, else by
    :func:`spearman` / :func:`pearson` (the same values)."""
    pairs = [(lab, s) for lab, s in zip(labels, scores) if s is not None]
    n = len(pairs)
    xs, ys = [float(a) for a, _ in pairs], [float(b) for _, b in pairs]
    rho, r = spearman(xs, ys), pearson(xs, ys)
    if not math.isnan(rho) and not math.isnan(r):
        try:
            from scipy import stats

            rho, r = float(stats.spearmanr(xs, ys).statistic), float(stats.pearsonr(xs, ys).statistic)
        except ImportError:
            pass
    return Agreement(n=n, unparsed=len(labels) - n,
                     exact=sum(a == b for a, b in pairs) / n if n else 0.0,
                     within1=sum(abs(a - b) <= 1 for a, b in pairs) / n if n else 0.0,
                     spearman=round(rho, 3), pearson=round(r, 3))
