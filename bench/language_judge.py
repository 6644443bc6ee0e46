"""Which language a reply is in: the judge of ``bench voice --lang`` and of the reply-language
tests (issue 35).

It is py3langid (https://github.com/adbar/py3langid, BSD-3-Clause; a maintained fork of
Lui & Baldwin's langid.py, "langid.py: An Off-the-shelf Language Identification Tool", ACL
2012): a naive Bayes classifier over byte n-grams whose model ships inside the wheel (no
download), restricted to the languages in question, so a short reply is weighed only between
them ("Es ist drei Uhr." → ``de``; "Because it is blue." → ``en``). A reply with no evidence
either way (``"OK."``, ``""``: equal probabilities) gets no verdict.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

UNDECIDED_MARGIN = 0.02
"""A best probability within this of an even split (1 / number of candidates) is no verdict."""

_lock = threading.Lock()


@dataclass(frozen=True, slots=True)
class Verdict:
    """The judge's answer for one text."""

    language: str | None  # the most likely candidate (ISO 639-1); None: no evidence either way
    probability: float  # its probability among the candidates, 0..1


@functools.cache
def _identifier(candidates: tuple[str, ...]) -> Any:
    """py3langid's identifier with normalised probabilities, restricted to ``candidates``
    (loading the model takes ~2 s, once per candidate set)."""
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    ident.set_languages(list(candidates))
    return ident


def judge(text: str, candidates: tuple[str, ...] = ("en", "de")) -> Verdict:
    """The language ``text`` is written in, among ``candidates``.

    Args:
        text: a reply (any length; punctuation and digits carry no weight).
        candidates: ISO 639-1 codes py3langid knows (97 languages), at least two.

    Returns:
        the most likely candidate and its probability; ``language`` None when the text gives
        no evidence (its best probability is within :data:`UNDECIDED_MARGIN` of an even split).

    Raises:
        ValueError: fewer than two candidates, or one py3langid does not know.
        ImportError: py3langid is not installed (the ``test`` extra).
    """
    if len(set(candidates)) < 2:
        raise ValueError(f"judge needs at least two candidate languages, got {candidates!r}")
    with _lock:  # the identifier keeps per-call state: one call at a time
        ident = _identifier(tuple(sorted(set(candidates))))
        language, probability = ident.classify(text)
    if probability <= 1 / len(set(candidates)) + UNDECIDED_MARGIN:
        return Verdict(None, float(probability))
    return Verdict(str(language), float(probability))


def speaks(text: str, language: str, candidates: tuple[str, ...] = ("en", "de")) -> bool:
    """Whether :func:`judge` says ``text`` is in ``language`` (one of ``candidates``, which
    it joins if missing)."""
    pool = candidates if language in candidates else (*candidates, language)
    return judge(text, pool).language == language
