"""The process-wide ASR stage: one Whisper model (faster-whisper / CTranslate2) behind a
batching worker.

Sessions submit :class:`~pipeline.asr.decode.DecodeRequest` (streaming updates of their
audio buffers, see :mod:`pipeline.asr.stream`); the worker thread collects the requests
of all sessions that arrive within ``max_wait_ms`` (up to ``max_batch_size``) and
decodes them together (:class:`~pipeline.asr.decode.BatchDecoder`). A whole utterance
can also be submitted as an :class:`AsrRequest` (faster-whisper's own ``transcribe``,
Whisper's 30 s windows: the offline reference). Model code — including iterating
faster-whisper's lazy ``segments`` generator — only ever runs in the worker thread.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from audio.pcm import RATE
from pipeline.asr.decode import BatchDecoder
from pipeline.asr.guards import cut_repetition
from pipeline.asr.types import AsrRequest, DecodeRequest, DecodeResult, Transcript
from pipeline.config import AsrConfig
from pipeline.serving.ladder import is_oom
from pipeline.worker import BatchWorker

logger = logging.getLogger(__name__)



class AsrEngine(BatchWorker[DecodeRequest | AsrRequest, DecodeResult | Transcript]):
    """The process-wide ASR stage.

    Args:
        model: a ``faster_whisper.WhisperModel``.
        cfg: batching, streaming and guard settings (see :class:`AsrConfig`).
    """

    def __init__(self, model, cfg: AsrConfig) -> None:
        super().__init__("asr", queue_size=cfg.queue_size, max_batch_size=cfg.max_batch_size,
                         max_wait_ms=cfg.max_wait_ms)
        self.model = model
        self.cfg = cfg
        self.multilingual = bool(getattr(model.model, "is_multilingual", True))
        self.english_only = not self.multilingual
        self.decoder = BatchDecoder(model, cfg)
        self.batch_sizes: list[int] = []  # recent streaming batch sizes (metrics, benchmark)
        self.busy_s = 0.0  # time spent in process_batch (s)

    def priority(self, item: DecodeRequest | AsrRequest) -> int:
        """0 for a turn's final transcript (and the catch-up before it, and whole
        utterances): the user is waiting for it; 1 for a partial update (best effort); 2
        for a background decode (a refused turn's transcript: nobody waits for a reply)."""
        if isinstance(item, DecodeRequest) and item.background:
            return 2
        return 1 if isinstance(item, DecodeRequest) and not (item.final or item.urgent) else 0

    def batch_limit(self, priority: int) -> int:
        """Partial updates go in batches of at most ``partial_batch_size``: a final decode
        that arrives meanwhile waits for that batch, and on CPU the encoder runs per
        request anyway (batching partials saves little)."""
        return self.max_batch_size if priority == 0 else min(self.max_batch_size, self.cfg.partial_batch_size)

    @property
    def languages(self) -> list[str]:
        """Language codes the model accepts (``["en"]`` for English-only models)."""
        return list(self.model.supported_languages) if self.multilingual else ["en"]

    def process_batch(self, items: list[DecodeRequest | AsrRequest]) -> list[DecodeResult | Transcript | BaseException]:
        t0 = time.perf_counter()
        try:
            return self._process(items)
        finally:
            self.busy_s += time.perf_counter() - t0

    def _process(self, items: list[DecodeRequest | AsrRequest]) -> list[DecodeResult | Transcript | BaseException]:
        out: list[DecodeResult | Transcript | BaseException | None] = [None] * len(items)
        stream = [(i, it) for i, it in enumerate(items) if isinstance(it, DecodeRequest)]
        if stream:
            self.batch_sizes = (self.batch_sizes + [len(stream)])[-1000:]
            for (i, _), res in zip(stream, self.decoder.decode([it for _, it in stream])):
                out[i] = res
        for i, it in enumerate(items):
            if isinstance(it, AsrRequest):
                try:
                    out[i] = self.transcribe(it)
                except Exception as exc:
                    if is_oom(exc):  # out of memory: the stage's ladder handles the whole batch
                        raise
                    out[i] = exc
        return [r if r is not None else RuntimeError("no result") for r in out]

    def decode(self, reqs: list[DecodeRequest]) -> list[DecodeResult | BaseException]:
        """Decode streaming requests synchronously as one batch (worker thread, tests, bench)."""
        return self.decoder.decode(reqs)

    def transcribe(self, req: AsrRequest) -> Transcript:
        """Transcribe one utterance with faster-whisper's ``transcribe`` (30 s windows;
        any length) synchronously: the offline reference (worker thread, tests, bench)."""
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
            if silent or seg.compression_ratio > c.compression_ratio_threshold or not any(ch.isalnum() for ch in text):
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
