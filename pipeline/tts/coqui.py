"""Coqui TTS behind the TTS stage (``--tts coqui:PATH``): a model folder the user brings
(``config.json`` + a checkpoint), checked at start-up by :mod:`pipeline.tts.coqui_folder`
and loaded by :mod:`pipeline.tts.coqui_loader` (never downloaded). Needs the ``coqui``
extra (``pip install -e ".[coqui]"``).
"""

from __future__ import annotations

import logging

import numpy as np

from pipeline.config import TtsConfig
from pipeline.tts.catalogue import language_code
from pipeline.tts.chunker import speakable
from pipeline.tts.coqui_folder import check_model_folder
from pipeline.tts.coqui_loader import load_coqui, use_threads
from pipeline.tts.engine import TtsEngine
from pipeline.tts.types import VoiceInfo

logger = logging.getLogger(__name__)

MAX_PIECE_CHARS = 250
"""Most characters given to the model at once: a longer phrase (a run-on reply gives the
chunker no punctuation to split at) is spoken in pieces cut at spaces, as Coqui's own
Synthesizer splits sentences. VITS's memory and time grow faster than the text, and a
call cannot be cancelled (one long call's cost: docs/BENCHMARKS.md)."""


class CoquiSynth:
    """One voice of a Coqui model: a speaker (of a multi-speaker model) in a language (of a
    multilingual one), or the model's one voice. The voices of one model share it (torch
    inference is read-only); :class:`~pipeline.tts.voices.Synth`'s contract.

    Args:
        model: the loaded Coqui model (:func:`pipeline.tts.coqui_loader.load_coqui`).
        info: the voice as clients see it (``backend`` ``coqui``).
        speaker: the model's speaker name (None: a one-speaker model).
        language: the model's language name (None: a one-language model).
        threads: torch threads of the calling worker thread.
    """

    def __init__(self, model, info: VoiceInfo, *, speaker: str | None = None, language: str | None = None,
                 threads: int = 1) -> None:
        self.model, self.info, self.threads = model, info, threads
        self.options = {k: v for k, v in (("speaker", speaker), ("language", language)) if v is not None}
        """What each ``model.synthesize`` call is given: ``speaker`` and ``language`` names."""

    def speak(self, text: str) -> np.ndarray:
        """Speak clean ``text`` in :func:`pieces`: float32 in [-1, 1], shape (n,), at
        ``info.sample_rate`` Hz. Runs in a worker thread, which sets its own torch thread
        count here (:func:`pipeline.tts.coqui_loader.use_threads`), not at load time."""
        use_threads(self.threads)
        wavs = [np.asarray(self.model.synthesize(piece, **self.options)["wav"], dtype=np.float32).reshape(-1)
                for piece in pieces(text)]
        return np.clip(np.concatenate(wavs), -1.0, 1.0) if wavs else np.zeros(0, np.float32)

    def on_idle(self) -> None:
        """Nothing to give back (torch's allocator keeps its own cache)."""


def model_voices(model, sample_rate: int, *, name: str, language: str = "en",
                 threads: int = 1) -> list[CoquiSynth]:
    """The voices of a loaded Coqui model, in id order (the first is the default): one per
    speaker of a multi-speaker model (its ``speaker_manager``) in each language of a
    multilingual one (``use_language_embedding``; its ``language_manager``), named
    ``NAME/SPEAKER``, ``NAME/SPEAKER/LANG`` or ``NAME/LANG`` (``NAME`` alone for a one-speaker,
    one-language model). A voice's language
    is the ISO 639-1 part of the model's language name (``pt-br`` → ``pt``), else ``language``.

    Args:
        model: the loaded model. sample_rate: its output rate (Hz).
        name: the model's name (its folder's). language: a one-language model's language.
        threads: torch threads of each worker thread.
    """
    speakers: list[str | None] = [*_names(getattr(model, "speaker_manager", None))]
    multilingual = bool(getattr(getattr(model, "args", None), "use_language_embedding", False))
    languages: list[str | None] = [*_names(getattr(model, "language_manager", None))] if multilingual else []
    out = []
    for speaker in speakers or [None]:
        for lang in languages or [None]:
            parts = [p for p in (name, speaker, lang) if p is not None]
            info = VoiceInfo(name="/".join(parts), language=language_code(lang) if lang else language,
                             backend="coqui", sample_rate=sample_rate)
            out.append(CoquiSynth(model, info, speaker=speaker, language=lang, threads=threads))
    return out


def _names(manager) -> list[str]:
    """A Coqui speaker or language manager's names in id order; none for one (or no) name."""
    ids = getattr(manager, "name_to_id", None) or {}
    return sorted(ids, key=lambda n: ids[n]) if len(ids) > 1 else []


class CoquiTtsEngine(TtsEngine):
    """A Coqui TTS model as the TTS stage: :class:`~pipeline.tts.engine.TtsEngine` with the
    model's voices (:func:`model_voices`: a multi-speaker model's speakers, a multilingual
    one's languages) in its catalogue, so ``session.start.voice`` picks a speaker and ``GET
    /v1/voices`` lists them; one model shared by ``cfg.workers`` threads (torch inference is
    read-only), audio at the model's rate. Each phrase is normalised for its voice's language
    (:func:`~pipeline.tts.normalize.verbalize`), cleaned (characters outside the model's
    alphabet are dropped by its tokenizer) and spoken in :func:`pieces`.

    Args:
        model: a loaded Coqui TTS model (:func:`pipeline.tts.coqui_loader.load_coqui`).
        sample_rate: its output rate (Hz).
        cfg: see :class:`TtsConfig`; ``cfg.threads`` torch threads in each worker thread.
        name: the model's name in its voices' names. language: a one-language model's
            ISO 639-1 code.
    """

    def __init__(self, model, sample_rate: int, cfg: TtsConfig, *, name: str = "coqui", language: str = "en") -> None:
        super().__init__(model_voices(model, sample_rate, name=name, language=language, threads=cfg.threads), cfg)
        self.model, self.threads = model, cfg.threads


def pieces(text: str, limit: int = MAX_PIECE_CHARS) -> list[str]:
    """``text`` cut at spaces into pieces of at most ``limit`` characters (a longer word is
    cut where it must); pieces with nothing to speak are dropped."""
    out: list[str] = []
    while len(text) > limit:
        cut = text.rfind(" ", 0, limit + 1)
        cut = cut if cut > 0 else limit
        out.append(text[:cut])
        text = text[cut:].lstrip()
    out.append(text)
    return [p.strip() for p in out if speakable(p)]


def load_coqui_engine(cfg: TtsConfig) -> CoquiTtsEngine:
    """The Coqui TTS stage for ``cfg.voice`` (a model folder), not started; its voices are
    named after the folder (:func:`model_voices`), a one-language model speaks its config's
    language (:func:`model_language`).

    Raises:
        ValueError, ImportError: see :func:`pipeline.tts.coqui_loader.load_coqui`.
    """
    model, rate = load_coqui(cfg.voice)
    folder = check_model_folder(cfg.voice).config.parent
    return CoquiTtsEngine(model, rate, cfg, name=folder.resolve().name or "coqui", language=model_language(model))


def model_language(model) -> str:
    """The ISO 639-1 language of a one-language Coqui model: its language manager's one name
    (Coqui takes it from the config's ``languages`` or ``phoneme_language``), else ``en``."""
    names = list(getattr(getattr(model, "language_manager", None), "name_to_id", None) or {})
    return language_code(names[0]) if len(names) == 1 and isinstance(names[0], str) and names[0] else "en"
