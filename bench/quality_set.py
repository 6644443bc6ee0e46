"""The fixed item set of ``voxpipe bench quality`` (``bench/quality_set.tsv``, issue 33).

Spoken-style user turns in five classes:

- ``fact``: a factual question with key-fact patterns (scored automatically: :func:`fact_ok`);
- ``request``: jokes, advice, how-to (scored by rules and the judge);
- ``talk``: statements, small talk and spoken commands (rules and the judge);
- ``followup``: the last turn of a short conversation whose earlier exchanges (the assistant's
  side scripted) are in the row; key-fact patterns where there is a fact, else the judge;
- ``clip``: what the server's default ASR transcribes from the 8 shared English clips, taken
  from ``bench/prompts.tsv``'s ``clip`` kind so that the two sets never drift apart (judge).

A fact pattern is a case-insensitive regular expression matched word-bounded (``\\b(?:...)\\b``)
against the reply after :func:`normalize` (NFKC, so "H₂O" reads ``h2o``; dashes as spaces, so
"fifty-six" reads ``fifty six``; thousands separators dropped, so "1,000" reads ``1000``).
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench.prompts import load_prompts

QUALITY_TSV = Path(__file__).with_name("quality_set.tsv")
"""The set: ``class<TAB>text<TAB>answers<TAB>history`` lines after that header; ``#`` comments."""
Class = Literal["fact", "request", "talk", "followup", "clip"]
CLASSES: tuple[Class, ...] = ("fact", "request", "talk", "followup", "clip")
HEADER = "class\ttext\tanswers\thistory"

Exchange = tuple[str, str]
"""One earlier (user, assistant) exchange."""


@dataclass(frozen=True, slots=True)
class Item:
    """One user turn of the set.

    Attributes:
        cls: its class (one of :data:`CLASSES`).
        text: the user's turn.
        answers: key-fact patterns (any one passes); empty: no key fact.
        history: the earlier exchanges of a followup, oldest first (empty for the other classes).
    """

    cls: Class
    text: str
    answers: tuple[str, ...] = ()
    history: tuple[Exchange, ...] = ()

    @property
    def has_fact(self) -> bool:
        """Whether the reply is scored by key-fact patterns (else by rules and/or the judge)."""
        return bool(self.answers)


def _history(field: str, where: str) -> tuple[Exchange, ...]:
    out = []
    for part in filter(None, (p.strip() for p in field.split(" // "))):
        user, sep, assistant = part.partition(" => ")
        if not sep or not user.strip() or not assistant.strip():
            raise ValueError(f"{where}: history exchange {part!r} is not 'user => assistant'")
        out.append((user.strip(), assistant.strip()))
    return tuple(out)


def load_items(path: Path = QUALITY_TSV, classes: tuple[str, ...] = CLASSES, limit: int = 0) -> list[Item]:
    """The items of ``path`` (plus the clip transcripts of ``bench/prompts.tsv``) whose class is
    in ``classes``, in class order then file order; ``limit`` > 0 keeps the first ``limit`` of
    each class.

    Raises:
        ValueError: a line without four columns, an unknown class, an empty text, a pattern
            that is not a regular expression, a followup without history or a history on
            another class (with the line number).
    """
    by_class: dict[str, list[Item]] = {c: [] for c in CLASSES}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip() or line.startswith("#") or line == HEADER:
            continue
        where = f"{path}:{n}"
        cols = line.split("\t")
        if len(cols) != 4 or cols[0] not in CLASSES or cols[0] == "clip" or not cols[1].strip():
            raise ValueError(f"{where}: want 'fact|request|talk|followup<TAB>text<TAB>answers<TAB>history', "
                             f"got {line!r}")
        cls, text, answers, history = cols
        pats = tuple(filter(None, (a.strip() for a in answers.split("|"))))
        for p in pats:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"{where}: bad answer pattern {p!r}: {exc}") from None
        exchanges = _history(history, where)
        if (cls == "followup") != bool(exchanges):
            raise ValueError(f"{where}: a followup needs history, and only a followup has one")
        by_class[cls].append(Item(cls, text.strip(), pats, exchanges))  # type: ignore[arg-type]
    by_class["clip"] = [Item("clip", p.text) for p in load_prompts(kinds=("clip",))]
    return [it for c in CLASSES if c in classes for it in (by_class[c][:limit] if limit > 0 else by_class[c])]


def pick(items: list[Item], counts: dict[str, int]) -> list[Item]:
    """The first ``counts[cls]`` items of each class named in ``counts`` (a fixed small subset)."""
    return [it for c in CLASSES if c in counts for it in [x for x in items if x.cls == c][:counts[c]]]


_DASH = re.compile(r"[-\u2010-\u2015]")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


def normalize(text: str) -> str:
    """``text`` as fact patterns see it: NFKC, lowercased, dashes as spaces, no thousands separators."""
    return _THOUSANDS.sub("", _DASH.sub(" ", unicodedata.normalize("NFKC", text).lower()))


def fact_ok(answers: tuple[str, ...], reply: str) -> bool:
    """Whether any pattern of ``answers`` occurs word-bounded in ``reply`` (case-insensitive,
    after :func:`normalize`); False for no patterns."""
    text = normalize(reply)
    return any(re.search(rf"\b(?:{p})\b", text, re.IGNORECASE) for p in answers)
