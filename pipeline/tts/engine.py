"""TTS behind a worker: phrase text → float32 audio at the voice's rate. :class:`PhraseEngine`
is the stage's contract; :class:`TtsEngine` speaks with the server's voices (Piper, loaded by
:func:`pipeline.tts.loader.load_voices`, or espeak-ng), :class:`pipeline.tts.coqui.CoquiTtsEngine`
with a Coqui TTS model."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipeline.config import TtsConfig
from pipeline.serving.ladder import is_oom
from pipeline.tts.catalogue import UnknownVoice, VoiceCatalogue, parse_voice
from pipeline.tts.chunker import speakable
from pipeline.tts.normalize import verbalize
from pipeline.tts.types import Phrase, Speech
from pipeline.tts.voices import PiperSynth, Synth
from pipeline.worker import BatchWorker

logger = logging.getLogger(__name__)

IDLE_SHRINK_S = 1.0
"""After this long without a phrase (s), Piper's bounded arena is shrunk (:meth:`TtsEngine.on_idle`)."""


class PhraseEngine(BatchWorker[Phrase | str, Speech]):
    """The process-wide TTS stage: phrase jobs from every session, the model(s) shared by a
    pool of ``cfg.workers`` threads. Each session awaits its phrases one by one, so its
    audio stays in order, and a cancelled reply submits no further phrase. A job is a
    :class:`Phrase` (text and voice) or a plain ``str`` (the default voice). Subclasses
    implement :meth:`speak` or :meth:`synthesize` (called in the worker threads, never on the
    event loop).

    Args:
        cfg: see :class:`TtsConfig`.
    """

    sample_rate: int
    """The default voice's output rate (Hz)."""

    def __init__(self, cfg: TtsConfig) -> None:
        super().__init__("tts", queue_size=cfg.queue_size, max_batch_size=1, workers=cfg.workers)

    def synthesize(self, text: str) -> Speech:
        """Speak one phrase with the default voice: float32 audio, shape (n,), at :attr:`sample_rate`."""
        raise NotImplementedError

    def speak(self, phrase: Phrase) -> Speech:
        """Speak one job; here ``phrase.voice`` is ignored (one voice: :meth:`synthesize`)."""
        return self.synthesize(phrase.text)

    def process_batch(self, items: list[Phrase | str]) -> list[Speech | BaseException]:
        out: list[Speech | BaseException] = []
        for item in items:
            phrase = item if isinstance(item, Phrase) else Phrase(item)
            try:
                out.append(self.speak(phrase))
            except Exception as exc:
                if is_oom(exc):  # out of memory: the stage's ladder handles the whole batch
                    raise
                logger.warning("tts failed on %r: %s", phrase.text, exc)
                out.append(exc)
        return out


class TtsEngine(PhraseEngine):
    """The server's voices behind one stage: each loaded once, shared by ``cfg.workers``
    threads and every session; a job names its voice (:class:`Phrase`), the first voice is
    the default. Text is normalised for the voice's language (:func:`verbalize`).

    Args:
        voices: the loaded voices (:class:`~pipeline.tts.voices.Synth`), default first; or a
            bare ``piper.PiperVoice``, the one voice, named as ``cfg.voice`` names it.
        cfg: see :class:`TtsConfig`.

    Raises:
        ValueError: no voice.
    """

    def __init__(self, voices: Sequence[Synth] | Any, cfg: TtsConfig) -> None:
        super().__init__(cfg)
        if not isinstance(voices, (list, tuple)):
            spec = parse_voice(cfg.voice)
            voices = [PiperSynth(voices, name=spec.name, language=spec.language)]
        if not voices:
            raise ValueError("TtsEngine needs at least one voice")
        self.synths: dict[str, Synth] = {s.info.name: s for s in voices}
        self.default: Synth = voices[0]
        self.catalogue = VoiceCatalogue([s.info for s in voices])
        self.sample_rate = self.default.info.sample_rate
        self.voice = getattr(self.default, "voice", None)
        """The default voice's ``PiperVoice`` (None for another backend)."""
        if any(getattr(s, "shrinks", False) for s in voices):  # a bounded arena (pipeline.tts.arena)
            self.idle_after_s = IDLE_SHRINK_S

    def on_idle(self) -> None:
        """Let each voice give back memory once per idle spell (a Piper voice in a bounded
        arena shrinks it with a one-word run, a few ms)."""
        for synth in self.synths.values():
            synth.on_idle()

    def synthesize(self, text: str, voice: str | None = None) -> Speech:
        """Speak ``text`` with the voice named ``voice`` (None: the default), after
        :func:`verbalize` in the voice's language (units, money, numbers as words) and
        :func:`speakable` cleaning; empty text gives no samples.

        Raises:
            UnknownVoice: no voice of that name; or the voice's own error.
        """
        synth = self.default if voice is None else self.synths.get(voice)
        if synth is None:
            raise UnknownVoice(f"unknown voice {voice!r}; available: {self.catalogue.names()}")
        t0 = time.perf_counter()
        clean = speakable(verbalize(text, synth.info.language))
        audio = synth.speak(clean) if clean else np.zeros(0, np.float32)
        return Speech(audio=audio, sample_rate=synth.info.sample_rate, synth_ms=(time.perf_counter() - t0) * 1000,
                      voice=synth.info.name)

    def speak(self, phrase: Phrase) -> Speech:
        return self.synthesize(phrase.text, phrase.voice)
