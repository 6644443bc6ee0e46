"""Whisper ASR (faster-whisper / CTranslate2) behind a batched worker.

One :class:`AsrEngine` per process owns the model; sessions submit whole utterances
(16 kHz mono float32) and await a :class:`Transcript`. faster-whisper's lazy
``segments`` generator is iterated inside the worker thread, never on the event loop.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass, field

import numpy as np

from .config import AsrConfig
from .worker import BatchWorker

logger = logging.getLogger(__name__)

RATE = 16000


@dataclass(slots=True)
class AsrRequest:
    """One utterance to transcribe.

    Attributes:
        audio: float32 samples at 16 kHz, shape (n,).
        language: ISO code such as ``en``, or None to detect (multilingual models only).
    """

    audio: np.ndarray
    language: str | None = None


@dataclass(slots=True)
class Transcript:
    """The result of one utterance.

    Attributes:
        text: the kept words ("" when nothing passed the hallucination guards).
        language: the language decoded.
        audio_s: utterance length (s).
        decode_ms: time spent in the model (ms).
        dropped: texts of segments removed by the guards, for logs.
    """

    text: str
    language: str
    audio_s: float
    decode_ms: float
    dropped: list[str] = field(default_factory=list)


def load_whisper(cfg: AsrConfig):
    """Load the Whisper model named by ``cfg.model`` (``tiny.en`` or a local folder).

    Raises:
        ModelNotInstalled: the model package is missing.
        ValueError: ``cfg.model`` is neither a known name nor a folder.
    """
    import os

    from faster_whisper import WhisperModel

    from . import model_files

    if cfg.model == "tiny.en":
        path = model_files.whisper_tiny_en_dir()
    elif os.path.isdir(cfg.model):
        path = cfg.model
    else:
        raise ValueError(f"unknown ASR model {cfg.model!r}: use 'tiny.en' or a CTranslate2 Whisper folder")
    device = cfg.device
    if device == "auto":
        import ctranslate2

        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    compute = cfg.compute_type
    if compute == "auto":
        compute = "float16" if device == "cuda" else "int8"
    return WhisperModel(str(path), device=device, compute_type=compute, cpu_threads=cfg.threads, num_workers=1)


_WORD = re.compile(r"[\w']+", re.UNICODE)


def cut_repetition(text: str, *, max_repeats: int = 3, max_ngram: int = 8) -> str:
    """Cut a runaway repetition loop: keep at most ``max_repeats`` consecutive copies of
    any n-gram (n ≤ ``max_ngram`` words); the words after the loop are kept.

    Whisper is known to loop on hesitant or noisy audio (CASES.md C02); the compression
    ratio guard catches long loops, this catches short ones.
    """
    words = text.split()
    keys = [w.lower().strip(".,!?") for w in words]
    i = 0
    while i < len(words):
        for n in range(1, max_ngram + 1):
            gram = keys[i : i + n]
            if len(gram) < n:
                break
            reps = 1
            while keys[i + reps * n : i + (reps + 1) * n] == gram:
                reps += 1
            if reps > max_repeats:
                cut = slice(i + max_repeats * n, i + reps * n)
                del words[cut], keys[cut]
                break
        i += 1
    return " ".join(words)


class AsrEngine(BatchWorker[AsrRequest, Transcript]):
    """The process-wide ASR stage.

    Args:
        model: a ``faster_whisper.WhisperModel``.
        cfg: thresholds and queue size (see :class:`AsrConfig`).
    """

    def __init__(self, model, cfg: AsrConfig) -> None:
        super().__init__("asr", queue_size=cfg.queue_size, max_batch_size=1)
        self.model = model
        self.cfg = cfg
        self.english_only = not getattr(model.model, "is_multilingual", True)

    def process_batch(self, items: list[AsrRequest]) -> list[Transcript | BaseException]:
        out: list[Transcript | BaseException] = []
        for item in items:
            try:
                out.append(self.transcribe(item))
            except Exception as exc:  # noqa: BLE001 - one bad request must not fail others
                out.append(exc)
        return out

    def transcribe(self, req: AsrRequest) -> Transcript:
        """Transcribe one utterance synchronously (worker thread or warm-up)."""
        c = self.cfg
        language = "en" if self.english_only else req.language
        t0 = time.perf_counter()
        segments, info = self.model.transcribe(
            req.audio.astype(np.float32, copy=False),
            language=language,
            beam_size=c.beam_size,
            temperature=0.0,
            vad_filter=False,  # the session already gated the audio with Silero VAD
            condition_on_previous_text=False,
            without_timestamps=True,
            no_speech_threshold=c.no_speech_threshold,
            log_prob_threshold=c.log_prob_threshold,
            compression_ratio_threshold=c.compression_ratio_threshold,
        )
        kept, dropped = [], []
        for seg in segments:  # lazy generator: iterate here, in the worker thread
            text = seg.text.strip()
            silent = seg.no_speech_prob > c.no_speech_threshold and seg.avg_logprob < c.log_prob_threshold
            if silent or seg.compression_ratio > c.compression_ratio_threshold or not _WORD.search(text):
                dropped.append(text)
            else:
                kept.append(text)
        text = cut_repetition(" ".join(kept).strip())
        if dropped:
            logger.info("asr dropped segments: %r", dropped)
        return Transcript(
            text=text,
            language=info.language,
            audio_s=len(req.audio) / RATE,
            decode_ms=(time.perf_counter() - t0) * 1000,
            dropped=dropped,
        )
