"""Circuit breaker: stop sending calls to a stage that fails or is slow, then probe it.

A pure policy (no I/O, no threads, no wall clock): every method takes ``now``, in seconds
from the caller's monotonic clock. States, rules and names follow resilience4j's
CircuitBreaker with a TIME_BASED sliding window (https://resilience4j.readme.io/docs/circuitbreaker):

- **CLOSED**: every call is permitted. Each outcome is recorded in a sliding window of the
  calls that ended in the last ``window_s`` seconds (slidingWindowSize): a call recorded at
  ``t`` counts while ``now - t < window_s``. Right after each record, if the window holds at
  least ``minimum_calls`` calls (minimumNumberOfCalls) and ``failed / calls >= failure_rate``
  or ``slow / calls >= slow_call_rate`` (resilience4j: "equal or greater than the
  threshold"), the breaker opens. So it opens on exactly the call that crosses a threshold,
  and never with fewer than ``minimum_calls`` calls in the window. Rates are compared as
  fractions (``3 / 10 >= 0.3`` holds exactly), not as ``failed >= rate * calls``.
- A call is **slow** when its duration is strictly greater than ``slow_call_s``
  (slowCallDurationThreshold, "the duration threshold above which calls are considered as
  slow"; resilience4j compares with ``>``). A failed call that was also slow counts as both.
- **OPEN**: no call is permitted. Outcomes reported now (calls permitted before it opened,
  ending late) are ignored. Once ``open_s`` (waitDurationInOpenState) has passed, i.e. at
  ``now >= opened_at + open_s``, it becomes HALF_OPEN: lazily, at the first method call from
  then on (every method applies the timeouts first), as automaticTransitionFromOpenToHalfOpen
  would have done.
- **HALF_OPEN**: at most ``half_open_calls`` calls (permittedNumberOfCallsInHalfOpenState) are
  permitted in the period; :meth:`CircuitBreaker.release` gives one back. Outcomes (of any
  call, as in resilience4j) are tallied apart from the window; once ``half_open_calls`` are
  in, the same two rate rules over them decide: over a threshold → OPEN (a new open period),
  else → CLOSED (a fresh, empty window). With ``max_half_open_s > 0``, a half-open period
  that lasted that long without a verdict judges the outcomes that came by the same rules
  (OPEN or CLOSED), and with none starts a new half-open period with fresh permits; ``0``
  waits for the verdict however long. (resilience4j's maxWaitDurationInHalfOpenState opens
  instead; here a stage that was simply idle, or whose permitted calls were cancelled before
  they ran, must neither stay stuck nor be punished as failing.)
- Each transition calls ``on_transition(name, old, new)`` exactly once, after the state has
  changed; a no-op is never reported. Entering any state empties the window and the tally.
  The window is a deque of ``(t, slow, failed)`` with running totals: O(1) amortised per call.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


OnTransition = Callable[[str, State, State], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class BreakerConfig:
    """Thresholds and durations; durations in seconds, rates as fractions in (0, 1]."""

    window_s: float = 10.0  # slidingWindowSize (TIME_BASED)
    slow_call_s: float = 1.0  # slowCallDurationThreshold: slow when duration > this
    slow_call_rate: float = 0.5  # slowCallRateThreshold: opens when slow / calls >= this
    failure_rate: float = 0.3  # failureRateThreshold: opens when failed / calls >= this
    minimum_calls: int = 5  # minimumNumberOfCalls in the window before any rate counts
    open_s: float = 10.0  # waitDurationInOpenState
    half_open_calls: int = 3  # permittedNumberOfCallsInHalfOpenState
    max_half_open_s: float = 0.0  # 0 = wait for the verdict; > 0: after this long, judge the probes that came
    # (none: fresh permits) — resilience4j's maxWaitDurationInHalfOpenState opens instead

    def __post_init__(self) -> None:
        for name in ("window_s", "slow_call_s", "open_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"BreakerConfig.{name} must be a finite number of seconds > 0, got {v!r}")
        if not (math.isfinite(self.max_half_open_s) and self.max_half_open_s >= 0):
            raise ValueError(f"BreakerConfig.max_half_open_s must be finite and >= 0, got {self.max_half_open_s!r}")
        for name in ("slow_call_rate", "failure_rate"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"BreakerConfig.{name} must be a fraction in (0, 1], got {v!r}")
        for name in ("minimum_calls", "half_open_calls"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"BreakerConfig.{name} must be an integer >= 1, got {v!r}")


class CircuitBreaker:
    """One breaker's state machine; see the module docstring for the exact rules."""

    def __init__(self, name: str, cfg: BreakerConfig, on_transition: OnTransition | None = None) -> None:
        self.name = name
        self.cfg = cfg
        self._on_transition = on_transition
        self._state = State.CLOSED
        self._since = 0.0  # when the current state began (OPEN: opened_at)
        self._window: deque[tuple[float, bool, bool]] = deque()  # CLOSED: (t, slow, failed)
        self._slow = self._failed = 0  # CLOSED: totals over the window
        self._probes = self._probe_slow = self._probe_failed = 0  # HALF_OPEN: outcomes tallied
        self._permits = 0  # HALF_OPEN: calls permitted (less those released) in this period

    @property
    def since(self) -> float:
        """When the current state began, or the current half-open period (seconds)."""
        return self._since

    def state(self, now: float) -> State:
        """The state at ``now`` (seconds), after applying the open/half-open timeouts."""
        self._tick(now)
        return self._state

    def try_acquire(self, now: float) -> bool:
        """May a call start at ``now`` (seconds)? True: permitted (end it with :meth:`on_success`,
        :meth:`on_error` or :meth:`release`); False: rejected, don't make the call."""
        self._tick(now)
        if self._state is State.CLOSED:
            return True
        if self._state is State.HALF_OPEN and self._permits < self.cfg.half_open_calls:
            self._permits += 1
            return True
        return False

    def release(self, now: float) -> None:
        """A permitted call ended at ``now`` (seconds) without an outcome (cancelled): give its
        half-open permit back (resilience4j's releasePermission). No-op in other states."""
        self._tick(now)
        if self._state is State.HALF_OPEN and self._permits > 0:
            self._permits -= 1

    def on_success(self, duration_s: float, now: float) -> None:
        """A permitted call succeeded after ``duration_s`` seconds, ending at ``now`` (seconds)."""
        self._record(duration_s, False, now)

    def on_error(self, duration_s: float, now: float) -> None:
        """A permitted call failed after ``duration_s`` seconds, ending at ``now`` (seconds)."""
        self._record(duration_s, True, now)

    def calls(self, now: float) -> int:
        """Calls counted at ``now``: in the window (CLOSED), in the tally (HALF_OPEN), 0 (OPEN)."""
        return self._counts(now)[0]

    def failure_rate(self, now: float) -> float:
        """Failed / calls (a fraction) of :meth:`calls`, or -1.0 while fewer than the minimum
        (``minimum_calls`` when CLOSED, ``half_open_calls`` when HALF_OPEN; always when OPEN)."""
        calls, _, failed, minimum = self._counts(now)
        return failed / calls if calls >= minimum else -1.0

    def slow_call_rate(self, now: float) -> float:
        """Slow / calls (a fraction) of :meth:`calls`, or -1.0 as for :meth:`failure_rate`."""
        calls, slow, _, minimum = self._counts(now)
        return slow / calls if calls >= minimum else -1.0

    def force_open(self, now: float) -> None:
        """Open now (resilience4j's transitionToOpenState): a new open period of ``open_s``
        seconds from ``now``, even if it was open already (then nothing is reported)."""
        self._enter(State.OPEN, now)

    def reset(self, now: float) -> None:
        """Close now with an empty window (resilience4j's reset)."""
        self._enter(State.CLOSED, now)

    def _record(self, duration_s: float, failed: bool, now: float) -> None:
        self._tick(now)
        cfg = self.cfg
        slow = duration_s > cfg.slow_call_s
        if self._state is State.CLOSED:
            self._window.append((now, slow, failed))
            self._slow += slow
            self._failed += failed
            calls = len(self._window)
            if calls >= cfg.minimum_calls and self._over(calls, self._slow, self._failed):
                self._enter(State.OPEN, now)
        elif self._state is State.HALF_OPEN:
            self._probes += 1
            self._probe_slow += slow
            self._probe_failed += failed
            if self._probes >= cfg.half_open_calls:
                over = self._over(self._probes, self._probe_slow, self._probe_failed)
                self._enter(State.OPEN if over else State.CLOSED, now)

    def _over(self, calls: int, slow: int, failed: int) -> bool:
        return failed / calls >= self.cfg.failure_rate or slow / calls >= self.cfg.slow_call_rate

    def _counts(self, now: float) -> tuple[int, int, int, int]:
        self._tick(now)
        if self._state is State.CLOSED:
            return len(self._window), self._slow, self._failed, self.cfg.minimum_calls
        if self._state is State.HALF_OPEN:
            return self._probes, self._probe_slow, self._probe_failed, self.cfg.half_open_calls
        return 0, 0, 0, 1

    def _tick(self, now: float) -> None:
        """Apply timeouts and window expiry. At most one transition: a state entered here
        starts at ``now``, so its own timeout (> 0 s) cannot have passed yet."""
        cfg = self.cfg
        if self._state is State.CLOSED:
            window = self._window
            while window and now - window[0][0] >= cfg.window_s:
                _, slow, failed = window.popleft()
                self._slow -= slow
                self._failed -= failed
        elif self._state is State.OPEN:
            if now >= self._since + cfg.open_s:
                self._enter(State.HALF_OPEN, now)
        elif cfg.max_half_open_s > 0 and now >= self._since + cfg.max_half_open_s:
            # the probe calls did not all come in time (an idle stage, or permits whose calls
            # were cancelled): judge the outcomes that came; with none, a new half-open period
            # with fresh permits (an idle stage proves nothing either way)
            if self._probes:
                over = self._over(self._probes, self._probe_slow, self._probe_failed)
                self._enter(State.OPEN if over else State.CLOSED, now)
            else:
                self._since, self._permits = now, 0

    def _enter(self, new: State, now: float) -> None:
        old, self._state, self._since = self._state, new, now
        self._window.clear()
        self._slow = self._failed = 0
        self._probes = self._probe_slow = self._probe_failed = self._permits = 0
        if old is not new and self._on_transition is not None:
            self._on_transition(self.name, old, new)
