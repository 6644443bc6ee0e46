"""Event-loop lag: how late the server's asyncio loop runs what is due.

Every session's audio, VAD, events and reply frames go through the one event loop; when
it is late, every turn is late by as much, on the way in and on the way out, whatever
the model stages do. :class:`LoopLag` sleeps ``interval_s`` at a time and measures the
overshoot (the standard probe, as Node's ``monitorEventLoopDelay``), exports it as the
``voxpipe_event_loop_lag_seconds`` histogram, and keeps a moving average that admission
adds to its prediction (:meth:`~pipeline.serving.admission.Admission.note_loop_lag`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pipeline import metrics


class LoopLag:
    """Probe the running loop's lag.

    Args:
        interval_s: time between probes (s).
        on_sample: called with each lag sample (ms), e.g. admission's ``note_loop_lag``.
    """

    def __init__(self, *, interval_s: float = 0.05, on_sample: Callable[[float], None] | None = None) -> None:
        self.interval_s, self.on_sample = interval_s, on_sample
        self.last_ms = 0.0
        self.samples = 0

    async def run(self) -> None:
        """Probe until cancelled."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            lag_ms = max(0.0, (time.perf_counter() - t0 - self.interval_s) * 1000)
            self.last_ms, self.samples = lag_ms, self.samples + 1
            metrics.LOOP_LAG.observe(lag_ms / 1000)
            if self.on_sample is not None:
                self.on_sample(lag_ms)
