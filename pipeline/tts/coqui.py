"""Coqui TTS behind the TTS stage (``--tts coqui:PATH``): a model folder the user brings
(``config.json`` + a checkpoint), checked at start-up by :mod:`pipeline.tts.coqui_folder`
and loaded by :mod:`pipeline.tts.coqui_loader` (never downloaded). Needs the ``coqui``
extra (``pip install -e ".[coqui]"``).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pipeline.config import TtsConfig
from pipeline.tts.chunker import speakable
from pipeline.tts.coqui_loader import load_coqui, use_threads
from pipeline.tts.engine import PhraseEngine
from pipeline.tts.normalize import verbalize
from pipeline.tts.types import Speech

logger = logging.getLogger(__name__)

MAX_PIECE_CHARS = 250
"""Most characters given to the model at once: a longer phrase (a run-on reply gives the
chunker no punctuation to split at) is spoken in pieces cut at spaces, as Coqui's own
Synthesizer splits sentences. VITS's memory and time grow faster than the text, and a
call cannot be cancelled (one long call's cost: docs/BENCHMARKS.md)."""


class CoquiTtsEngine(PhraseEngine):
    """A Coqui TTS model as the TTS stage: same contract as Piper's
    :class:`~pipeline.tts.engine.TtsEngine` (one model shared by ``cfg.workers`` threads;
    torch inference is read-only), audio at the model's rate.

    Args:
        model: a loaded Coqui TTS model (:func:`pipeline.tts.coqui_loader.load_coqui`).
        sample_rate: its output rate (Hz).
        cfg: see :class:`TtsConfig`; ``cfg.threads`` torch threads in each worker thread.
    """

    def __init__(self, model, sample_rate: int, cfg: TtsConfig) -> None:
        super().__init__(cfg)
        self.model, self.sample_rate, self.threads = model, sample_rate, cfg.threads

    def synthesize(self, text: str) -> Speech:
        """Speak ``text`` after :func:`verbalize` and :func:`speakable` cleaning (characters
        outside the model's alphabet are dropped by its tokenizer); empty text gives no samples,
        a phrase over :data:`MAX_PIECE_CHARS` is spoken in :func:`pieces`.
        Runs in a worker thread, which sets its own torch thread count here
        (:func:`pipeline.tts.coqui_loader.use_threads`), not at load time.
        """
        t0 = time.perf_counter()
        use_threads(self.threads)
        clean = speakable(verbalize(text))
        audio = np.zeros(0, np.float32)
        wavs = [np.asarray(self.model.synthesize(piece)["wav"], dtype=np.float32).reshape(-1)
                for piece in pieces(clean)]
        if wavs:
            audio = np.clip(np.concatenate(wavs), -1.0, 1.0)
        return Speech(audio=audio, sample_rate=self.sample_rate, synth_ms=(time.perf_counter() - t0) * 1000)


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
    """The Coqui TTS stage for ``cfg.voice`` (a model folder), not started.

    Raises:
        ValueError, ImportError: see :func:`pipeline.tts.coqui_loader.load_coqui`.
    """
    model, rate = load_coqui(cfg.voice)
    return CoquiTtsEngine(model, rate, cfg)
