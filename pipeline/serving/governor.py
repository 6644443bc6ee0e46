"""Degrade, don't die: one place that knows the service level and says what a turn gets.

The :class:`Governor` owns, per model stage, the out-of-memory ladder
(:mod:`pipeline.serving.ladder`) and the circuit breaker (:mod:`pipeline.serving.breaker`,
wrapped thread-safe by :class:`StageGuard`), and the SLO adaptation
(:mod:`pipeline.serving.slo_adapt`). It hands the stages their ladder, guard and fault
injector (:meth:`attach`), and answers the sessions:

- :meth:`refusal`: refuse a new turn now? ``busy`` reason ``ladder`` while a ladder climbs
  at step 2; reason ``breaker`` for a spoken turn while the ASR breaker is open (decided
  at the end of speech, without an ASR call).
- :meth:`turn_policy`: how to make the reply — normal; shorter replies and history (SLO
  level 1, or the LLM breaker open once); the fallback model (ladder step 3, SLO level 2,
  the LLM breaker open twice in a row); a spoken stock line (opened three times in a row).
  A TTS breaker that is open makes replies text-only: the TTS stage refuses the phrase
  (``Busy`` reason ``breaker``) and the responder goes on without audio.
- :meth:`conditions`: what is in force, sent to clients as ``server.status`` whenever it
  changes (:meth:`subscribe`).

Every transition is one log line (``event=oom_ladder|breaker|slo_adapt ...``), one counter
increment and a gauge (:mod:`pipeline.metrics`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import cast

from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.errors import Busy
from pipeline.fault_rules import STAGES, StageName
from pipeline.serving.breaker import BreakerConfig, CircuitBreaker, State
from pipeline.serving.faults import FaultInjector
from pipeline.serving.ladder import OomLadder
from pipeline.serving.slo_adapt import SloAdapter
from pipeline.serving.types import Condition, TurnPolicy

logger = logging.getLogger(__name__)

TICK_S = 0.5
"""How often the housekeeping task steps ladders down, times breakers out and re-judges the SLO."""
_STATE_CODE = {State.CLOSED: 0, State.OPEN: 1, State.HALF_OPEN: 2}


class StageGuard:
    """A stage's :class:`CircuitBreaker`, thread-safe on the monotonic clock: the
    :class:`~pipeline.worker.CallGuard` a stage's worker uses."""

    def __init__(self, breaker: CircuitBreaker, clock: Callable[[], float] = time.monotonic) -> None:
        self.breaker, self._clock = breaker, clock
        self._lock = threading.Lock()

    def permit(self) -> bool:
        """Whether a call may go ahead now (``try_acquire``)."""
        with self._lock:
            return self.breaker.try_acquire(self._clock())

    def record(self, duration_s: float, failed: bool) -> None:
        """A call's outcome: its service time (s), failed or not."""
        with self._lock:
            now = self._clock()
            if failed:
                self.breaker.on_error(duration_s, now)
            else:
                self.breaker.on_success(duration_s, now)

    def state(self) -> State:
        """The breaker's state now."""
        with self._lock:
            return self.breaker.state(self._clock())

    def open_left_s(self) -> float:
        """Seconds until an open breaker lets probes through (0 when not open)."""
        with self._lock:
            now = self._clock()
            if self.breaker.state(now) is not State.OPEN:
                return 0.0
            return max(0.0, self.breaker._since + self.breaker.cfg.open_s - now)


class Governor:
    """The server's service level (see the module docstring).

    Args:
        cfg: the configuration (``cfg.degrade``, the SLO, the LLM's limits).
        fallback: whether a fallback LLM is configured (ladder step 3, SLO level 2).
        faults: the fault injector the stages check (:meth:`attach`).
        clock: monotonic seconds (tests inject their own).
    """

    def __init__(self, cfg: VoxpipeConfig, *, fallback: bool, faults: FaultInjector,
                 clock: Callable[[], float] = time.monotonic) -> None:
        d = self.d = cfg.degrade
        self.cfg, self.fallback, self.faults, self.clock = cfg, fallback, faults, clock
        self.ladders: dict[str, OomLadder] = {
            s: OomLadder(s, max_step=3 if s == "llm" and fallback else 2, calm_s=d.ladder_calm_s,
                         on_transition=self._ladder_moved) for s in STAGES}
        self.guards: dict[str, StageGuard] = {s: StageGuard(CircuitBreaker(s, BreakerConfig(
            window_s=d.breaker_window_s, slow_call_s=d.breaker_slow_ms.get(s, 1000.0) / 1000,
            slow_call_rate=d.breaker_slow_rate, failure_rate=d.breaker_failure_rate,
            minimum_calls=d.breaker_min_calls, open_s=d.breaker_open_s, half_open_calls=d.breaker_probes,
            max_half_open_s=d.breaker_window_s), on_transition=self._breaker_moved), clock) for s in STAGES}
        self.adapter = SloAdapter(cfg.admission.slo_ms, d, max_level=2 if fallback else 1,
                                  on_transition=self._adapt_moved)
        self.llm_opens = 0  # the LLM breaker's openings since it last closed
        self._adapt_lock = threading.Lock()
        self._listeners: list[Callable[[list[Condition]], None]] = []
        self._published: list[Condition] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        for s in STAGES:
            metrics.LADDER_STEP.labels(s).set(0)
            metrics.BREAKER_STATE.labels(s).set(0)
        metrics.SLO_LEVEL.set(0)

    # ---- wiring --------------------------------------------------------------------

    def attach(self, stages: dict[str, object]) -> None:
        """Give each in-process stage (``asr``, ``llm``, ``tts`` → its engine) its fault
        injector, ladder and guard; stages without those attributes (fakes, remote stages)
        are left alone."""
        for name, stage in stages.items():
            if stage is not None and hasattr(stage, "ladder") and hasattr(stage, "guard"):
                stage.faults = self.faults  # type: ignore[attr-defined]
                stage.ladder = self.ladders[name]
                stage.guard = self.guards[name]

    async def run(self) -> None:
        """Housekeeping on the event loop, every :data:`TICK_S`: :meth:`tick`. Cancel to stop."""
        self._loop = asyncio.get_running_loop()
        while True:
            self.tick()
            await asyncio.sleep(TICK_S)

    def subscribe(self, listener: Callable[[list[Condition]], None]) -> Callable[[], None]:
        """Call ``listener(conditions)`` on the event loop whenever they change; returns
        the unsubscribe function."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def tick(self) -> None:
        """Step calm ladders down, time breakers out, re-judge the SLO; publish changes."""
        now = self.clock()
        for ladder in self.ladders.values():
            ladder.tick(now)
        for guard in self.guards.values():
            guard.state()
        with self._adapt_lock:
            self.adapter.tick(now)
        self._publish()

    # ---- what sessions ask ------------------------------------------------------------

    def observe_v2v(self, ms: float) -> None:
        """A reply's voice-to-voice time (ms), for the SLO adaptation."""
        with self._adapt_lock:
            self.adapter.observe(ms, self.clock())

    def refusal(self, *, spoken: bool) -> Busy | None:
        """Why a turn ending now must be refused, or None (see the module docstring)."""
        now = self.clock()
        for name, ladder in self.ladders.items():
            if ladder.refusing and (spoken or name != "asr"):  # a typed turn needs no ASR
                return Busy(f"the {name} stage ran out of memory twice: new turns are refused while it recovers",
                            reason="ladder", retry_after_ms=max(500, int(ladder.calm_left(now) * 1000)))
        if spoken and self.guards["asr"].state() is State.OPEN:
            left = self.guards["asr"].open_left_s()
            return Busy("speech recognition is failing (its circuit breaker is open): type instead, or try later",
                        reason="breaker", retry_after_ms=max(500, int(left * 1000)))
        return None

    def turn_policy(self) -> TurnPolicy:
        """How the next reply is made (see the module docstring)."""
        llm, d = self.cfg.llm, self.d
        new, ctx, fallback, reasons = llm.max_new_tokens, llm.max_context_tokens, False, []
        level = self.adapter.level
        if level >= 1:
            new, ctx = max(8, int(new * d.adapt_factor)), max(128, int(ctx * d.adapt_factor))
            reasons.append(f"slo level {level}")
        if level >= 2 and self.fallback:
            fallback = True
        if self.ladders["llm"].step >= 3:
            fallback = True
            reasons.append("llm ladder step 3")
        state = self.guards["llm"].state()
        if state is State.OPEN and self.llm_opens >= 3 or state is State.OPEN and self.llm_opens == 2 \
                and not self.fallback:
            return TurnPolicy(max_new_tokens=new, context_tokens=ctx, stock_line=d.stock_line,
                              reasons=(*reasons, "llm breaker open"))
        if state is not State.CLOSED:
            new = min(new, d.short_reply_tokens)
            reasons.append(f"llm breaker {state.value}")
            if state is State.OPEN and self.llm_opens == 2:
                fallback = True
        return TurnPolicy(max_new_tokens=new, context_tokens=ctx, fallback=fallback, reasons=tuple(reasons))

    def conditions(self) -> list[Condition]:
        """What is in force now (empty: normal service)."""
        out: list[Condition] = []
        for name, ladder in self.ladders.items():
            if ladder.step:
                effect = {1: "ran out of memory: cached memory freed, service goes on",
                          2: "ran out of memory again: smaller batches"
                             + (", new turns refused" if ladder.refusing else ""),
                          3: "new turns are answered by the smaller fallback model"}[ladder.step]
                out.append(Condition(source="ladder", stage=cast(StageName, name), level=str(ladder.step),
                                     effect=effect))
        for name, guard in self.guards.items():
            state = guard.state()
            if state is not State.CLOSED:
                out.append(Condition(source="breaker", stage=cast(StageName, name), level=state.value,
                                     effect=self._breaker_effect(name, state)))
        if self.adapter.level:
            effect = "replies are shorter to keep the latency SLO" + (
                "; new turns use the smaller fallback model" if self.adapter.level >= 2 else "")
            out.append(Condition(source="slo", stage=None, level=str(self.adapter.level), effect=effect))
        return out

    def _breaker_effect(self, stage: str, state: State) -> str:
        if state is State.HALF_OPEN:
            return f"{stage} is being probed after failing or slowing down"
        if stage == "asr":
            return "speech recognition is failing: spoken turns are refused (typing works)"
        if stage == "tts":
            return "speech synthesis is failing or slow: replies are text only"
        if self.llm_opens >= 3 or self.llm_opens == 2 and not self.fallback:
            return "the language model is failing: a stock reply only"
        if self.llm_opens == 2:
            return "the language model is failing or slow: the smaller fallback model answers"
        return "the language model is failing or slow: replies are shorter"

    # ---- transitions (any thread) -----------------------------------------------------------

    def _ladder_moved(self, stage: str, old: int, new: int) -> None:
        metrics.LADDER_TRANSITIONS.labels(stage, str(new)).inc()
        metrics.LADDER_STEP.labels(stage).set(new)
        self._soon()

    def _breaker_moved(self, stage: str, old: State, new: State) -> None:
        if stage == "llm":
            self.llm_opens = self.llm_opens + 1 if new is State.OPEN else 0 if new is State.CLOSED else self.llm_opens
        logger.warning("event=breaker stage=%s from=%s to=%s", stage, old.value, new.value)
        metrics.BREAKER_TRANSITIONS.labels(stage, new.value).inc()
        metrics.BREAKER_STATE.labels(stage).set(_STATE_CODE[new])
        self._soon()

    def _adapt_moved(self, old: int, new: int, p95_ms: float | None) -> None:
        logger.warning("event=slo_adapt from=%d to=%d p95_ms=%s slo_ms=%.0f", old, new,
                       "none" if p95_ms is None else f"{p95_ms:.0f}", self.cfg.admission.slo_ms)
        metrics.SLO_TRANSITIONS.labels(str(new)).inc()
        metrics.SLO_LEVEL.set(new)
        self._soon()

    def _soon(self) -> None:
        """Publish from the event loop as soon as it can (transitions come from stage threads)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._publish)

    def _publish(self) -> None:
        conditions = self.conditions()
        if conditions == self._published:
            return
        self._published = conditions
        for listener in list(self._listeners):
            try:
                listener(conditions)
            except Exception:  # one session's listener must not stop the others
                logger.exception("server.status listener failed")
