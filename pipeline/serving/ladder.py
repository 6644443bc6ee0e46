"""The out-of-memory ladder of one model stage: each allocation failure steps it down a level.

Degrade, don't die: the remedy for memory pressure (a stage dies for every client otherwise,
as vLLM's engine does on CUDA OOM, vllm#52871; docs/ARCHITECTURE.md, admission and
degradation):

- step 1 (the first OOM): free cached memory (the CUDA caching allocator's blocks, prefix
  caches, the heap's free pages) and retry the call: the turn completes;
- step 2 (another OOM): halve the stage's batch size, requeue (not fail) the newest
  requests, and refuse new turns with ``busy`` reason ``ladder`` while climbing at this step;
- step 3 (a third, LLM only): new turns go to the smaller fallback model, switched at a turn
  boundary (a reply already streaming stays on its model).

With no OOM for ``calm_s`` (60 s) the ladder steps back down one level, then again after
another calm period. Each transition calls ``on_transition(stage, old, new)`` once (the
caller logs one line, counts ``voxpipe_oom_ladder_transitions_total{stage,step}`` once and
sets the step gauge). An OOM at the top step changes nothing (no transition).

Thread-safe: stage threads report OOMs; the server's housekeeping task calls :meth:`tick`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)

OOM_MARKERS = ("out of memory", "failed to allocate", "bad_alloc", "cannot allocate memory", "oom when allocating")
"""Lower-case fragments of allocation failures raised as plain RuntimeErrors: PyTorch's
CUDA ("CUDA out of memory"), CTranslate2 ("std::bad_alloc", "out of memory"), onnxruntime
("Failed to allocate memory for requested buffer"), glibc via torch ("Cannot allocate memory")."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure: :class:`MemoryError` (Python's, and injected
    ones), ``torch.OutOfMemoryError`` (a RuntimeError), or a RuntimeError whose message holds
    one of :data:`OOM_MARKERS`."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RuntimeError):
        if type(exc).__name__ == "OutOfMemoryError":
            return True
        text = str(exc).lower()
        return any(m in text for m in OOM_MARKERS)
    return False


def free_cached_memory() -> None:
    """Ladder step 1's housekeeping for any stage: a full garbage collection, the CUDA
    caching allocator's free blocks back to the driver (if torch is loaded and CUDA is up),
    and the heap's free pages back to the OS (glibc ``malloc_trim``)."""
    import sys

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    release_free_memory()


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Steps of many different lengths leave the engine thread's malloc arena fragmented:
    200 mixed-length requests grew RSS by 200-450 MB that was free but never returned.
    Called when the engine goes idle, so it costs no step any time.
    """
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if isinstance(_LIBC, ctypes.CDLL):
        _LIBC.malloc_trim(0)


_LIBC: ctypes.CDLL | bool | None = None  # None: not loaded yet; False: no malloc_trim here


Transition = Callable[[str, int, int], None]


class OomLadder:
    """One stage's ladder position (0 = normal).

    Args:
        stage: ``asr`` | ``llm`` | ``tts`` (for logs and metrics).
        max_step: the top step (3 for the LLM with a fallback model, else 2).
        calm_s: a calm period: no OOM for this long steps down one level (s).
        on_transition: ``(stage, old_step, new_step)`` once per transition.
    """

    def __init__(self, stage: str, *, max_step: int = 2, calm_s: float = 60.0,
                 on_transition: Transition | None = None) -> None:
        if max_step < 1 or calm_s <= 0:
            raise ValueError("max_step must be >= 1 and calm_s > 0")
        self.stage, self.max_step, self.calm_s = stage, max_step, calm_s
        self.on_transition = on_transition
        self.step = 0
        self.climbing = False  # the current step was reached by an OOM (not by stepping down)
        self.ooms = 0
        self._since = 0.0  # when the step last changed or the last OOM came (monotonic s)
        self._lock = threading.Lock()

    def oom(self, now: float) -> int:
        """Record an allocation failure at ``now`` (monotonic s); returns the step now in force."""
        with self._lock:
            self.ooms += 1
            self._since = now
            old = self.step
            self.step, self.climbing = min(old + 1, self.max_step), True
        if self.step != old:
            self._changed(old, self.step)
        return self.step

    def tick(self, now: float) -> int:
        """Step down one level if the last OOM or step change is ``calm_s`` ago; returns the step."""
        with self._lock:
            old = self.step
            if old == 0 or now - self._since < self.calm_s:
                return old
            self.step, self.climbing, self._since = old - 1, False, now
        self._changed(old, old - 1)
        return old - 1

    def calm_left(self, now: float) -> float:
        """Seconds until the next step down if no OOM comes (0 at step 0)."""
        return 0.0 if self.step == 0 else max(0.0, self._since + self.calm_s - now)

    @property
    def refusing(self) -> bool:
        """New turns are refused: step 2 reached by an OOM (on the way down, step 2 only
        keeps the halved batch)."""
        return self.step == 2 and self.climbing

    def batch_size(self, base: int) -> int:
        """The stage's batch size at this step: ``base`` halved from step 2 on (at least 1)."""
        return max(1, base // 2) if self.step >= 2 else base

    def _changed(self, old: int, new: int) -> None:
        effect = _MEANING[new] if new > old else _DOWN[new]
        logger.warning("event=oom_ladder stage=%s from=%d to=%d effect=%r", self.stage, old, new, effect)
        if self.on_transition is not None:
            self.on_transition(self.stage, old, new)


_MEANING = {0: "normal service", 1: "cached memory freed, call retried", 2: "batch halved, new turns refused",
            3: "new turns go to the fallback model"}
_DOWN = {0: "normal service", 1: "full batch again", 2: "main model again, batch still halved, no refusals"}
