"""The LLM engine's step statistics: steps run, a step's time, batch sizes, tokens sampled.

The engine-wide counterpart of the per-request :class:`~pipeline.llm.types.GenStats`, as
vLLM v1 keeps its ``IterationStats`` beside the per-request ones (vllm/v1/metrics/stats.py).
Written by the engine thread; read from any thread (plain attributes and ``list`` s).
"""

from __future__ import annotations

import time

from pipeline import metrics

BATCH_LOG = 100_000
"""Steps whose batch size and sampled tokens are kept (the first ones; benchmarks, tests)."""
STEP_MS_WEIGHT = 0.1
"""Weight of a new step's time in :attr:`StepStats.step_ms`'s moving average."""


class StepStats:
    """Per-step records of one engine.

    Attributes:
        steps: model steps run so far (a step that only frees batch rows counts).
        step_ms: moving average of a model step's time (ms), at the batch it ran; 0 before
            the first step that computed anything.
        batch_sizes: per step that computed, the requests in it (the first :data:`BATCH_LOG`).
        token_log: per such step, ``(time.perf_counter() at its end (s), tokens sampled)``.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.step_ms = 0.0
        self.batch_sizes: list[int] = []
        self.token_log: list[tuple[float, int]] = []

    def timed(self, ms: float) -> None:
        """A step that computed took ``ms``: fold it into :attr:`step_ms` (the first one sets it)."""
        self.step_ms = ms if self.step_ms == 0.0 else self.step_ms + STEP_MS_WEIGHT * (ms - self.step_ms)

    def record(self, size: int, sampled: int) -> None:
        """Count a step of ``size`` requests (0: it only freed rows) that sampled ``sampled``
        tokens; a computing step is observed in Prometheus' ``voxpipe_llm_batch_size``."""
        self.steps += 1
        if not size:
            return
        metrics.LLM_BATCH.observe(size)
        if len(self.batch_sizes) < BATCH_LOG:
            self.batch_sizes.append(size)
            self.token_log.append((time.perf_counter(), sampled))
