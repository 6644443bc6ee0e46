"""Backchannels: short acknowledgements a listener gives while the other one speaks ("yeah",
"mm-hm", "okay", "right", "I see"). Pure functions, no I/O.

Speech over the assistant's reply that is only a backchannel does not take the floor: it
neither cancels the reply nor gets a reply of its own (:mod:`pipeline.session.barge_in`).

The word lists are modelled on the acknowledgement tokens of conversation analysis
(Yngve 1970, "On getting a word in edgewise", who named backchannels; Schegloff 1982,
"Discourse as an interactional achievement: some uses of 'uh huh' and other things that
come between sentences") and on the examples that voice-agent frameworks give for the
speech their interruption handling lets pass ("uh-huh", "okay", "right" in LiveKit Agents'
interruption handling docs; "yeah", "okay", "mm-hmm" in Pipecat's interruption
strategies). They are written the way Whisper transcribes them ("Mm-hmm.", "Uh-huh.",
"Okay.", "Yeah, yeah."): matching ignores case, punctuation, hyphens, apostrophes,
accents and drawn-out letters, so "Mmm-hmm!", "mhm" and "MM HMM" are one word.

A text is a backchannel when every word of it belongs to a phrase of the list (its
language's, English's — Whisper spells hums the English way in any language — and the
configured extras), it has at most ``backchannel_max_words`` words and its speech lasted at
most ``backchannel_max_ms``.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from pipeline.config import TurnConfig

BACKCHANNELS: Mapping[str, tuple[str, ...]] = {
    "en": ("yeah", "yes", "yep", "yup", "yah", "ya", "mm-hmm", "mhm", "mm", "hmm", "hm", "uh-huh", "uh huh",
           "mm hmm", "okay", "ok", "right", "all right", "alright", "sure", "i see", "got it", "gotcha", "oh",
           "ah", "aha", "uh", "um", "er", "erm", "cool", "great", "nice", "good", "fine", "true", "exactly",
           "totally", "absolutely", "of course", "sounds good", "makes sense", "that makes sense", "wow",
           "indeed", "i know", "thanks", "thank you", "yes yes", "oh yeah", "oh okay", "oh i see",
           "okay okay", "right right"),
    "de": ("ja", "jaja", "jo", "jep", "genau", "stimmt", "richtig", "okay", "ok", "mhm", "aha", "achso",
           "ach so", "alles klar", "klar", "gut", "super", "verstehe", "ich verstehe", "echt", "sicher",
           "natürlich", "in ordnung", "ach", "na klar"),
    "fr": ("oui", "ouais", "d'accord", "d'acc", "ok", "okay", "mhm", "hum", "ah", "oh", "voilà", "exactement",
           "c'est ça", "bien sûr", "je vois", "ah bon", "super", "parfait", "tout à fait", "effectivement",
           "carrément", "bon", "ah oui", "oui oui"),
    "es": ("sí", "vale", "claro", "ya", "ajá", "mhm", "ok", "okay", "bueno", "exacto", "de acuerdo", "entiendo",
           "ya veo", "bien", "perfecto", "cierto", "claro que sí", "eso", "sí sí", "ah"),
    "it": ("sì", "certo", "ok", "okay", "va bene", "esatto", "giusto", "capito", "ho capito", "ah", "mhm", "già",
           "vero", "perfetto", "d'accordo", "bene", "ecco", "sì sì"),
    "pt": ("sim", "é", "tá", "ok", "okay", "certo", "claro", "uhum", "aham", "entendi", "exato", "beleza",
           "tá bom", "isso", "pois é", "pois", "com certeza", "perfeito", "ah"),
    "nl": ("ja", "jaja", "oké", "ok", "okay", "precies", "klopt", "inderdaad", "zeker", "goed", "prima", "mhm",
           "aha", "juist", "snap ik", "ik snap het", "duidelijk", "natuurlijk", "oh", "ja ja"),
}
"""Built-in backchannels per language (ISO 639-1 code → phrases, as people write them)."""

Heard = Literal["nothing", "backchannel", "echo", "words"]
"""What speech over a reply turned out to say: no words, only a backchannel, the reply's own
echo (:mod:`pipeline.session.echo_guard`), or words."""

_SPLIT = re.compile(r"[\s,.;:!?¡¿…—–\"“”„«»()\[\]]+")
_RUNS = re.compile(r"(.)\1+")


def words(text: str) -> list[str]:
    """``text``'s words, normalized for matching: lower case, accents, hyphens, apostrophes
    and other marks inside a word dropped, letters drawn out to one ("Mmm-hmm!" → ``mhm``,
    "Yeahhh" → ``yeah``, "d'accord" → ``daccord``); empty words (lone punctuation) left out."""
    out = []
    for raw in _SPLIT.split(unicodedata.normalize("NFKD", text.casefold())):
        kept = "".join(ch for ch in raw if ch.isalnum())
        if kept:
            out.append(_RUNS.sub(r"\1", kept))
    return out


def _phrases(entries: Iterable[str]) -> frozenset[tuple[str, ...]]:
    return frozenset(p for p in (tuple(words(e)) for e in entries) if p)


@dataclass(slots=True, frozen=True)
class Backchannels:
    """The backchannel rule of one server (its lists and limits).

    Attributes:
        phrases: per language, the normalized phrases (tuples of :func:`words`).
        extra: the configured extra phrases (every language).
        max_ms: speech longer than this is never a backchannel (ms).
        max_words: more words than this is never a backchannel.
    """

    phrases: Mapping[str, frozenset[tuple[str, ...]]]
    extra: frozenset[tuple[str, ...]]
    max_ms: float
    max_words: int

    @classmethod
    def from_config(cls, cfg: TurnConfig) -> Backchannels:
        """The rule of ``cfg`` (``backchannel_words``, ``backchannel_max_ms``, ``backchannel_max_words``)."""
        return cls(phrases={lang: _phrases(entries) for lang, entries in BACKCHANNELS.items()},
                   extra=_phrases(cfg.backchannel_words.split(",")), max_ms=float(cfg.backchannel_max_ms),
                   max_words=cfg.backchannel_max_words)

    def vocabulary(self, language: str | None) -> frozenset[tuple[str, ...]]:
        """The phrases that count for ``language`` (ISO code): its list, English's and the
        extras; every list when the language is unknown (None, or one without a list)."""
        if language is None or language not in self.phrases:
            return frozenset().union(self.extra, *self.phrases.values())
        return self.phrases[language] | self.phrases["en"] | self.extra

    def only_backchannel(self, text: str, language: str | None = None) -> bool:
        """Every word of ``text`` belongs to a backchannel phrase (and it has words): the
        word rule alone, without the length limits."""
        return _covered(words(text), self.vocabulary(language))

    def is_backchannel(self, text: str, speech_ms: float, language: str | None = None) -> bool:
        """``text`` (a transcript of ``speech_ms`` of speech) is a backchannel: at most
        :attr:`max_words` words, all of backchannel phrases, and at most :attr:`max_ms` long."""
        ws = words(text)
        return 0 < len(ws) <= self.max_words and speech_ms <= self.max_ms and _covered(ws, self.vocabulary(language))

    def heard(self, text: str, speech_ms: float, language: str | None = None) -> Heard:
        """What ``text`` is: ``nothing`` (no words), ``backchannel`` (:meth:`is_backchannel`) or ``words``."""
        if not words(text):
            return "nothing"
        return "backchannel" if self.is_backchannel(text, speech_ms, language) else "words"


def _covered(ws: list[str], vocab: frozenset[tuple[str, ...]]) -> bool:
    """``ws`` (non-empty) splits into phrases of ``vocab`` (dynamic programming over prefixes)."""
    if not ws:
        return False
    longest = max((len(p) for p in vocab), default=0)
    ok = [True] + [False] * len(ws)  # ok[i]: ws[:i] splits into phrases
    for i in range(1, len(ws) + 1):
        ok[i] = any(ok[i - n] and tuple(ws[i - n : i]) in vocab for n in range(1, min(longest, i) + 1))
    return ok[-1]
