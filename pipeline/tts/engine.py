"""TTS behind a worker: phrase text → float32 audio at the voice's rate. :class:`PhraseEngine`
is the stage's contract; :class:`TtsEngine` speaks with Piper (the voice is loaded by
:func:`pipeline.tts.loader.load_voice`), :class:`pipeline.tts.coqui.CoquiTtsEngine` with a
Coqui TTS model."""

from __future__ import annotations

import logging
import time

import numpy as np

from pipeline.config import TtsConfig
from pipeline.serving.ladder import is_oom
from pipeline.tts.chunker import speakable
from pipeline.tts.normalize import verbalize
from pipeline.tts.types import Speech
from pipeline.worker import BatchWorker

logger = logging.getLogger(__name__)

IDLE_SHRINK_S = 1.0
"""After this long without a phrase (s), Piper's bounded arena is shrunk (:meth:`TtsEngine.on_idle`)."""
SHRINK_TEXT = "Okay."
"""The one-word run whose end shrinks the arena."""


class PhraseEngine(BatchWorker[str, Speech]):
    """The process-wide TTS stage: phrase jobs from every session, one model shared by a
    pool of ``cfg.workers`` threads. Each session awaits its phrases one by one, so its
    audio stays in order, and a cancelled reply submits no further phrase. Subclasses
    implement :meth:`synthesize` (called in the worker threads, never on the event loop).

    Args:
        cfg: see :class:`TtsConfig`.
    """

    sample_rate: int
    """The model's output rate (Hz)."""

    def __init__(self, cfg: TtsConfig) -> None:
        super().__init__("tts", queue_size=cfg.queue_size, max_batch_size=1, workers=cfg.workers)

    def synthesize(self, text: str) -> Speech:
        """Speak one phrase: float32 audio, shape (n,), at :attr:`sample_rate`."""
        raise NotImplementedError

    def process_batch(self, items: list[str]) -> list[Speech | BaseException]:
        out: list[Speech | BaseException] = []
        for text in items:
            try:
                out.append(self.synthesize(text))
            except Exception as exc:
                if is_oom(exc):  # out of memory: the stage's ladder handles the whole batch
                    raise
                logger.warning("tts failed on %r: %s", text, exc)
                out.append(exc)
        return out


class TtsEngine(PhraseEngine):
    """Piper: one voice shared by ``cfg.workers`` threads (onnxruntime sessions are safe to
    run concurrently).

    Args:
        voice: a ``piper.PiperVoice``.
        cfg: see :class:`TtsConfig`.
    """

    def __init__(self, voice, cfg: TtsConfig) -> None:
        super().__init__(cfg)
        self.voice = voice
        self.sample_rate = int(voice.config.sample_rate)
        if hasattr(voice.session, "shrink_next"):  # a bounded arena (pipeline.tts.arena)
            self.idle_after_s = IDLE_SHRINK_S

    def on_idle(self) -> None:
        """Shrink onnxruntime's arena with a one-word run (a few ms), once per idle spell (a
        no-op without the bounded arena)."""
        if not hasattr(self.voice.session, "shrink_next"):
            return
        self.voice.session.shrink_next()
        for _ in self.voice.synthesize(SHRINK_TEXT):
            pass

    def synthesize(self, text: str) -> Speech:
        """Speak ``text`` after :func:`verbalize` (units, money, numbers as words) and
        :func:`speakable` cleaning; empty text gives no samples."""
        t0 = time.perf_counter()
        clean = speakable(verbalize(text))
        parts = [chunk.audio_float_array for chunk in self.voice.synthesize(clean)] if clean else []
        audio = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return Speech(audio=audio, sample_rate=self.sample_rate, synth_ms=(time.perf_counter() - t0) * 1000)
