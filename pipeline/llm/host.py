"""The LLM engine thread's use of the host between model steps: it borrows the cores the
other stages leave idle for the next step (:mod:`pipeline.cpu_share`), and gives freed heap
pages back to the OS once the engine goes idle (:func:`~pipeline.serving.ladder.release_free_memory`).
Engine thread only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline.config import LlmConfig
from pipeline.cpu_share import SHARE
from pipeline.serving.ladder import release_free_memory

if TYPE_CHECKING:
    from pipeline.llm.runner.runner import ModelRunner


class HostShare:
    """Thread count and heap trimming for one engine.

    Args:
        runner: the model runner whose torch threads are set.
        cfg: ``threads`` (what :func:`~pipeline.llm.loader.load_llm` set) and ``burst_threads``.
    """

    def __init__(self, runner: ModelRunner, cfg: LlmConfig) -> None:
        self.runner, self.cfg = runner, cfg
        self._threads_now = cfg.threads  # torch threads of the engine thread
        self._trimmed_at = 0  # steps run when the heap was last trimmed

    def pick_threads(self) -> None:
        """Borrow the idle cores for the next step: ``burst_threads`` while no ASR/TTS call is
        in progress, else ``threads`` (``burst_threads`` None: no burst)."""
        cfg = self.cfg
        burst = cfg.burst_threads or 0
        want = burst if burst > cfg.threads and not SHARE.others_working else cfg.threads
        if want != self._threads_now:
            self.runner.set_threads(want)
            self._threads_now = want

    def idle(self, steps: int) -> None:
        """The engine has no work after ``steps`` steps: return freed heap pages to the OS
        (:func:`release_free_memory`) once per idle period, not on every wake-up."""
        if steps != self._trimmed_at:
            self._trimmed_at = steps
            release_free_memory()
