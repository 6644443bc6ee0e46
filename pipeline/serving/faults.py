"""Fault injection for tests and drills: make a stage run out of memory, fail, or turn slow.

A rule (:mod:`pipeline.fault_rules`) names a stage, a kind, the call it starts at and how many
calls it lasts::

    STAGE:KIND[@FIRST][xCOUNT]      e.g.  llm:oom@1x2   tts:slow:2000@1x6   asr:error@3x*

- ``STAGE``: ``asr`` | ``llm`` | ``tts``. A *call* is one batch of the ASR or TTS worker
  (:class:`~pipeline.worker.BatchWorker`) or one model step of the LLM engine, counted from 1
  after the server's warm-up (:meth:`FaultInjector.arm`).
- ``KIND``: ``oom`` (raises :class:`InjectedOom`, a :class:`MemoryError`, which the stage's
  out-of-memory ladder treats like a real allocation failure), ``error`` (raises
  :class:`InjectedFault`), ``slow:<ms>`` (sleeps that long in the stage's thread first).
- ``@FIRST``: the first call hit (1). ``xCOUNT``: calls hit from there (1); ``x*``: every call.

Rules come from ``--fault`` (repeatable) or the ``VOXPIPE_FAULTS`` environment variable
(rules separated by ``,`` or ``;``); ``SIGUSR1`` to the server stops them all (the end of a
drill). Off by default; when no rule names a stage, its check is one dictionary lookup.
"""

from __future__ import annotations

import logging
import threading
import time

from pipeline.fault_rules import STAGES, FaultRule

logger = logging.getLogger(__name__)


class InjectedOom(MemoryError):
    """An injected out-of-memory error (:mod:`pipeline.serving.faults`)."""


class InjectedFault(RuntimeError):
    """An injected stage failure (:mod:`pipeline.serving.faults`)."""


def injected(exc: BaseException) -> bool:
    """Whether ``exc`` was injected (logged without a traceback: it has no story to tell)."""
    return isinstance(exc, (InjectedOom, InjectedFault))


class FaultInjector:
    """Counts each stage's calls and applies the rules that hit them (thread-safe).

    Args:
        rules: the parsed rules (empty: never does anything).
        sleep: how a ``slow`` rule waits (``time.sleep``; tests inject their own).
    """

    def __init__(self, rules: tuple[FaultRule, ...] = (), *, sleep=time.sleep) -> None:
        self._rules: dict[str, tuple[FaultRule, ...]] = {
            s: tuple(r for r in rules if r.stage == s) for s in STAGES if any(r.stage == s for r in rules)}
        self._calls: dict[str, int] = dict.fromkeys(self._rules, 0)
        self._armed = not rules
        self._lock = threading.Lock()
        self._sleep = sleep
        self.injected: dict[str, int] = dict.fromkeys(self._rules, 0)

    @property
    def active(self) -> bool:
        """Whether any rule is configured."""
        return bool(self._rules)

    def arm(self) -> None:
        """Start counting calls (after warm-up: the warm-up's calls are not counted)."""
        with self._lock:
            self._armed = True
            self._calls = dict.fromkeys(self._rules, 0)
        if self._rules:
            logger.warning("fault injection armed: %s", "; ".join(
                f"{r.stage}:{r.kind}{f':{r.slow_ms}' if r.kind == 'slow' else ''}@{r.first}x{r.count or '*'}"
                for rules in self._rules.values() for r in rules))

    def clear(self) -> None:
        """Stop injecting (``SIGUSR1`` to ``voxpipe serve``: the end of a drill)."""
        with self._lock:
            had, self._rules = bool(self._rules), {}
        if had:
            logger.warning("fault injection stopped")

    def hit(self, stage: str) -> None:
        """Called by ``stage`` at the start of each call (in its own thread): sleeps for a
        ``slow`` rule that hits this call, then raises for an ``oom`` or ``error`` one.

        Raises:
            InjectedOom, InjectedFault: as the rules say.
        """
        rules = self._rules.get(stage)
        if not rules:
            return
        with self._lock:
            if not self._armed:
                return
            self._calls[stage] += 1
            call = self._calls[stage]
        for rule in rules:
            if not rule.hits(call):
                continue
            self.injected[stage] += 1
            if rule.kind == "slow":
                self._sleep(rule.slow_ms / 1000)
            elif rule.kind == "oom":
                raise InjectedOom(f"injected out of memory in {stage} (call {call})")
            else:
                raise InjectedFault(f"injected failure in {stage} (call {call})")


NO_FAULTS = FaultInjector()
"""An injector without rules (the default)."""
