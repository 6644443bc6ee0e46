"""Adapting to the SLO at run time: when the measured voice-to-voice p95 drifts over the
SLO, ask less of the LLM; give it back step by step once under it for a while.

A pure policy on an injected clock (``now``: monotonic seconds). Levels:

- 0: normal service;
- 1: shorter replies and a smaller history budget (``max_new_tokens`` and the prompt's
  token budget × ``adapt_factor``): fewer decode steps per turn, shorter prefills;
- 2: also new turns go to the fallback model (when there is one).

Only samples taken since the last change count (the new level's effect is measured
afresh). Up one level when at least ``adapt_min_samples`` of them (within
``adapt_window_s``) have a p95 over the SLO and the last change is ``adapt_up_s`` ago; down
one when the last change is ``adapt_down_s`` ago and at least ``adapt_min_samples`` of them
have a p95 under ``adapt_restore`` × SLO, or no turn at all came for ``adapt_window_s`` (an
idle server: nothing shows the overload any more). Too few turns to judge is no evidence
either way: the level holds. Admission (part 1) refuses what
cannot be answered in time; this policy makes what is admitted cheaper, so fewer turns are
refused — a remedy asked for in livekit/agents#6982.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

from pipeline.config import DegradeConfig


def p95(samples: list[float]) -> float:
    """The 95th percentile by nearest rank (``sorted[ceil(0.95 n) − 1]``).

    Raises:
        ValueError: no samples.
    """
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    return ordered[math.ceil(0.95 * len(ordered)) - 1]


class SloAdapter:
    """The adaptation level (0..``max_level``) from voice-to-voice samples.

    Args:
        slo_ms: the voice-to-voice SLO (ms).
        cfg: ``adapt_*`` settings.
        max_level: 2 with a fallback model, else 1.
        on_transition: ``(old_level, new_level, p95_ms or None)``, once per change.
    """

    def __init__(self, slo_ms: float, cfg: DegradeConfig, *, max_level: int = 2,
                 on_transition: Callable[[int, int, float | None], None] | None = None) -> None:
        self.slo_ms, self.cfg, self.max_level = slo_ms, cfg, max_level
        self.on_transition = on_transition
        self.level = 0
        self._changed = -math.inf  # when the level last changed (monotonic s)
        self._samples: deque[tuple[float, float]] = deque(maxlen=200)  # (t, voice-to-voice ms)

    def observe(self, v2v_ms: float, now: float) -> int:
        """Record a turn's voice-to-voice time (ms) at ``now``; returns the level."""
        self._samples.append((now, v2v_ms))
        return self.tick(now)

    def recent(self, now: float) -> list[float]:
        """The samples that count now: within the window and since the last change."""
        since = now - self.cfg.adapt_window_s
        return [ms for t, ms in self._samples if t >= since and t > self._changed]

    def tick(self, now: float) -> int:
        """Step up or down if the rules say so (see the module docstring); returns the level."""
        if not self.cfg.adapt:
            return self.level
        recent = self.recent(now)
        judged = p95(recent) if len(recent) >= self.cfg.adapt_min_samples else None
        quiet = now - self._changed
        if judged is not None and judged > self.slo_ms and self.level < self.max_level \
                and quiet >= self.cfg.adapt_up_s:
            self._move(self.level + 1, now, judged)
        elif self.level > 0 and quiet >= self.cfg.adapt_down_s and (
                judged is not None and judged <= self.cfg.adapt_restore * self.slo_ms or self._idle(now)):
            self._move(self.level - 1, now, judged)
        return self.level

    def _idle(self, now: float) -> bool:
        """No turn at all within the window: nothing shows the overload any more."""
        return not self._samples or now - self._samples[-1][0] >= self.cfg.adapt_window_s

    def _move(self, level: int, now: float, judged: float | None) -> None:
        old, self.level, self._changed = self.level, level, now
        if self.on_transition is not None:
            self.on_transition(old, level, judged)
