"""The process-wide end-of-turn stage: Smart Turn v3.2 behind one batching worker thread.

Sessions ``await engine.run(audio)`` on the event loop; the request (the turn's last 8 s,
copied) waits in a bounded queue; the worker thread takes up to ``eot_batch_size`` queued
requests, from any sessions, computes their features and runs them as one ONNX batch
(:class:`~pipeline.worker.BatchWorker`: the event loop never runs model code). A full queue
refuses at once with :class:`~pipeline.errors.Busy` (reason ``stage``): the session then
decides the turn on silence alone.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from pipeline import metrics
from pipeline.config import TurnConfig
from pipeline.eot.features import WINDOW, batch_features
from pipeline.eot.loader import EotModel, load_eot_model
from pipeline.eot.types import EotStats
from pipeline.errors import Busy
from pipeline.worker import BatchWorker

QUEUE_PER_BATCH = 4
"""The queue holds this many batches' worth of requests (``4 x eot_batch_size``): a request
behind them would come back after the silence rule had already decided the turn."""


class EotEngine(BatchWorker[np.ndarray, float]):
    """The end-of-turn stage (:class:`pipeline.stages.EotStage`).

    Args:
        model: the loaded model (:func:`~pipeline.eot.loader.load_eot_model`).
        batch_size: most requests in one ONNX batch (``--eot-batch-size``).
        queue_size: most requests waiting (None: ``QUEUE_PER_BATCH x batch_size``).
    """

    def __init__(self, model: EotModel, *, batch_size: int = 8, queue_size: int | None = None) -> None:
        super().__init__("eot", queue_size=queue_size or QUEUE_PER_BATCH * batch_size, max_batch_size=batch_size)
        self.model = model
        self._lock = threading.Lock()
        self._stats = EotStats()

    @classmethod
    def from_config(cls, cfg: TurnConfig) -> EotEngine:
        """Load ``cfg.eot_model`` with ``cfg.eot_threads`` threads; batches of ``cfg.eot_batch_size``
        (not started). Slow: call off the event loop.

        Raises:
            ModelNotInstalled, FileNotFoundError, ValueError: see :func:`~pipeline.eot.loader.load_eot_model`.
        """
        return cls(load_eot_model(cfg.eot_model, threads=cfg.eot_threads), batch_size=cfg.eot_batch_size)

    @property
    def stats(self) -> EotStats:
        """What the stage has done so far (a snapshot; any thread)."""
        with self._lock:
            return self._stats

    async def run(self, item: np.ndarray, *, priority: int | None = None) -> float:
        """The probability (0..1) that the turn is complete.

        Args:
            item: the turn's audio, float32 in [-1, 1], shape (n,), 16 kHz mono (its last 8 s
                are used: only they are copied into the queue).
            priority: unused (every request is a turn someone waits on).

        Raises:
            ValueError: ``item`` is not one-dimensional.
            Busy: the queue is full (reason ``stage``).
        """
        if item.ndim != 1:
            raise ValueError(f"end-of-turn audio must be one-dimensional, got shape {item.shape}")
        tail = np.array(item[-WINDOW:], dtype=np.float32)  # a copy: the session's buffer goes on growing
        try:
            fut = self.submit(tail)
        except Busy:
            metrics.EOT_REFUSED.inc()
            self._add(refused=1)
            raise
        return await fut

    def process_batch(self, items: list[np.ndarray]) -> list[float | BaseException]:
        """Features of each turn, then one model run on them all (worker thread).

        Raises:
            the model's exception (every request of the batch gets it).
        """
        t0 = time.perf_counter()
        probs = self.model.predict(batch_features(items))
        seconds = time.perf_counter() - t0
        metrics.EOT_SECONDS.observe(seconds)
        metrics.EOT_BATCH.observe(len(items))
        self._add(requests=len(items), batches=1, last_batch=len(items), busy_s=seconds)
        return [float(p) for p in probs]

    def _add(self, *, requests: int = 0, batches: int = 0, last_batch: int = 0, refused: int = 0,
             busy_s: float = 0.0) -> None:
        with self._lock:
            s = self._stats
            self._stats = EotStats(requests=s.requests + requests, batches=s.batches + batches,
                                   max_batch=max(s.max_batch, last_batch), last_batch=last_batch or s.last_batch,
                                   refused=s.refused + refused, busy_s=s.busy_s + busy_s)
