"""Fault injection for tests and drills: make a stage run out of memory, fail, or turn slow.

A rule names a stage, a kind, the call it starts at and how many calls it lasts::

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
import re
import threading
import time
from dataclasses import dataclass
from typing import Literal, cast

logger = logging.getLogger(__name__)

StageName = Literal["asr", "llm", "tts"]
FaultKind = Literal["oom", "error", "slow"]
STAGES: tuple[StageName, ...] = ("asr", "llm", "tts")
ENV = "VOXPIPE_FAULTS"
_RULE = re.compile(r"^(asr|llm|tts):(oom|error|slow:(\d+))(?:@(\d+))?(?:x(\d+|\*))?$")


class InjectedOom(MemoryError):
    """An injected out-of-memory error (:mod:`pipeline.serving.faults`)."""


class InjectedFault(RuntimeError):
    """An injected stage failure (:mod:`pipeline.serving.faults`)."""


def injected(exc: BaseException) -> bool:
    """Whether ``exc`` was injected (logged without a traceback: it has no story to tell)."""
    return isinstance(exc, (InjectedOom, InjectedFault))


@dataclass(slots=True, frozen=True)
class FaultRule:
    """One parsed rule (see the module docstring).

    Attributes:
        stage: the stage hit. kind: ``oom`` | ``error`` | ``slow``. slow_ms: the delay of
        a ``slow`` rule (ms). first: the first call hit (1-based). count: calls hit (None: all).
    """

    stage: StageName
    kind: FaultKind
    slow_ms: int = 0
    first: int = 1
    count: int | None = 1

    @classmethod
    def parse(cls, text: str) -> FaultRule:
        """Parse ``STAGE:KIND[@FIRST][xCOUNT]``.

        Raises:
            ValueError: not a rule, or a first call < 1 or a count < 1.
        """
        m = _RULE.match(text.strip())
        if m is None:
            raise ValueError(f"bad fault rule {text!r}: expected STAGE:KIND[@FIRST][xCOUNT] with STAGE asr|llm|tts "
                             "and KIND oom|error|slow:<ms>, e.g. llm:oom@1x2 or tts:slow:2000@1x*")
        stage, kind, slow, first, count = m.groups()
        n_first = int(first) if first else 1
        n_count = None if count == "*" else int(count) if count else 1
        if n_first < 1 or (n_count is not None and n_count < 1):
            raise ValueError(f"bad fault rule {text!r}: the first call and the count start at 1")
        return cls(stage=cast(StageName, stage), kind=cast(FaultKind, "slow" if slow else kind),
                   slow_ms=int(slow or 0), first=n_first, count=n_count)

    def hits(self, call: int) -> bool:
        """Whether call number ``call`` (1-based) is hit."""
        return call >= self.first and (self.count is None or call < self.first + self.count)


def parse_rules(specs: list[str] | tuple[str, ...]) -> tuple[FaultRule, ...]:
    """Parse rules; each spec may hold several, separated by ``,`` or ``;``.

    Raises:
        ValueError: a bad rule, or a spec with none.
    """
    rules: list[FaultRule] = []
    for spec in specs:
        parts = [part for part in re.split(r"[,;]", spec) if part.strip()]
        if not parts:
            raise ValueError(f"empty fault rule {spec!r}: expected STAGE:KIND[@FIRST][xCOUNT]")
        rules.extend(FaultRule.parse(part) for part in parts)
    return tuple(rules)


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
