"""The circuit breaker policy (pipeline/serving/breaker.py): scripted scenarios, one row each,
and properties over random call sequences. Pure: no server, no models, no wall clock."""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Sequence
from typing import Any

import pytest

from pipeline.serving.breaker import BreakerConfig, CircuitBreaker, State

CLOSED, OPEN, HALF = State.CLOSED, State.OPEN, State.HALF_OPEN
FAST, SLOW = 0.1, 2.0  # seconds; the default slow_call_s is 1.0

Step = tuple[Any, ...]


def oks(n: int, t: float, d: float = FAST, dt: float = 0.0) -> list[Step]:
    """n successes lasting d seconds, ending at t, t + dt, ..."""
    return [("ok", d, t + i * dt) for i in range(n)]


def errs(n: int, t: float, d: float = FAST, dt: float = 0.0) -> list[Step]:
    return [("err", d, t + i * dt) for i in range(n)]


def acquires(n: int, t: float, want: bool = True) -> list[Step]:
    return [("acquire", t, want)] * n


# Defaults: window_s=10, slow_call_s=1, slow_call_rate=0.5, failure_rate=0.3, minimum_calls=5,
# open_s=10, half_open_calls=3, max_half_open_s=0.
OPENED_AT_4: list[Step] = [*errs(5, 0.0, dt=1.0), ("state", 4.0, OPEN)]  # the 5th failure opens at t=4
HALF_OPEN_AT_14: list[Step] = [*OPENED_AT_4, ("state", 14.0, HALF)]
TRIPPED = [(CLOSED, OPEN), (OPEN, HALF)]  # the transitions of HALF_OPEN_AT_14

SCENARIOS: list[tuple[str, dict[str, Any], list[Step]]] = [
    ("never-opens-below-minimum-calls", {}, [
        *errs(4, 0.0, dt=1.0), ("state", 3.0, CLOSED), ("calls", 3.0, 4), ("rates", 3.0, -1.0, -1.0),
        ("err", FAST, 4.0), ("state", 4.0, OPEN), ("events", [(CLOSED, OPEN)]),
    ]),
    ("failure-rate-opens-on-exactly-the-crossing-call", {}, [
        *oks(6, 0.0), *errs(2, 1.0), ("state", 1.0, CLOSED), ("rates", 1.0, 0.25, 0.0),  # 2/8
        ("err", FAST, 1.0), ("state", 1.0, OPEN), ("events", [(CLOSED, OPEN)]),  # 3/9
    ]),
    ("failure-rate-exactly-at-threshold-opens", {}, [
        *oks(7, 0.0), *errs(2, 1.0), ("state", 1.0, CLOSED), ("err", FAST, 1.0), ("state", 1.0, OPEN),  # 3/10 = 0.3
    ]),
    ("failure-rate-just-below-threshold-stays-closed", {}, [
        *oks(8, 0.0), *errs(3, 1.0), ("state", 1.0, CLOSED), ("rates", 1.0, 3 / 11, 0.0), ("events", []),
    ]),
    ("slow-rate-opens-on-exactly-the-crossing-call", {"slow_call_rate": 0.45}, [
        *oks(5, 0.0), *oks(4, 1.0, SLOW), ("state", 1.0, CLOSED), ("rates", 1.0, 0.0, 4 / 9),
        ("ok", SLOW, 1.0), ("state", 1.0, OPEN), ("events", [(CLOSED, OPEN)]),  # 5/10
    ]),
    ("slow-rate-exactly-at-threshold-opens", {}, [
        *oks(5, 0.0), *oks(4, 1.0, SLOW), ("state", 1.0, CLOSED), ("ok", SLOW, 1.0), ("state", 1.0, OPEN),  # 5/10 = 0.5
    ]),
    ("a-call-of-exactly-slow-call-s-is-not-slow", {}, [
        *oks(5, 0.0, 1.0), ("state", 0.0, CLOSED), ("rates", 0.0, 0.0, 0.0),
        ("ok", 1.000001, 0.0), ("rates", 0.0, 0.0, 1 / 6),
    ]),
    ("a-slow-failure-counts-as-failed-and-slow", {"failure_rate": 0.9, "slow_call_rate": 0.9}, [
        *oks(4, 0.0), ("err", SLOW, 0.0), ("state", 0.0, CLOSED), ("rates", 0.0, 0.2, 0.2),
    ]),
    ("a-slow-failure-can-open-on-the-slow-rate", {"failure_rate": 0.9, "slow_call_rate": 0.4}, [
        *oks(3, 0.0), ("ok", SLOW, 0.0), ("state", 0.0, CLOSED), ("err", SLOW, 0.0), ("state", 0.0, OPEN),  # slow 2/5
    ]),
    ("rejects-while-open", {}, [
        *OPENED_AT_4, ("acquire", 4.0, False), ("acquire", 9.0, False), ("acquire", 13.999, False),
        ("state", 13.999, OPEN), ("calls", 13.999, 0), ("rates", 13.999, -1.0, -1.0),
    ]),
    ("half-open-after-open-s-and-not-a-moment-before", {}, [
        *OPENED_AT_4, ("state", 13.999999, OPEN), ("acquire", 14.0, True), ("state", 14.0, HALF),
        ("events", TRIPPED),
    ]),
    ("half-open-permits-exactly-half-open-calls", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), ("acquire", 14.0, False), ("acquire", 20.0, False),
    ]),
    ("half-open-waits-for-all-outcomes-before-deciding", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), ("err", FAST, 14.5), ("err", FAST, 14.6), ("state", 14.6, HALF),
        ("calls", 14.6, 2), ("rates", 14.6, -1.0, -1.0), ("err", FAST, 14.7), ("state", 14.7, OPEN),
    ]),
    ("half-open-successes-close-with-a-fresh-window", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), *oks(3, 14.5), ("state", 14.5, CLOSED), ("calls", 14.5, 0),
        ("acquire", 14.5, True), ("events", [*TRIPPED, (HALF, CLOSED)]),
        *errs(4, 15.0), ("state", 15.0, CLOSED), ("err", FAST, 15.0), ("state", 15.0, OPEN),
    ]),
    ("half-open-failure-reopens-for-a-new-open-period", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), *oks(2, 14.5), ("err", FAST, 15.0), ("state", 15.0, OPEN),  # 1/3
        ("acquire", 24.9, False), ("acquire", 25.0, True), ("events", [*TRIPPED, (HALF, OPEN), (OPEN, HALF)]),
    ]),
    ("half-open-slowness-reopens", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), ("ok", FAST, 14.5), *oks(2, 15.0, SLOW), ("state", 15.0, OPEN),
    ]),
    ("half-open-below-both-thresholds-closes", {"half_open_calls": 4}, [
        *HALF_OPEN_AT_14, *acquires(4, 14.0), ("ok", SLOW, 14.5), ("err", FAST, 14.5), *oks(2, 14.5),
        ("state", 14.5, CLOSED),  # failed 1/4 < 0.3, slow 1/4 < 0.5
    ]),
    ("outcomes-while-open-are-ignored", {}, [
        *OPENED_AT_4, *oks(3, 5.0), *errs(3, 6.0), ("state", 13.0, OPEN), ("calls", 13.0, 0),
        ("state", 14.0, HALF), ("calls", 14.0, 0), ("events", TRIPPED),
    ]),
    ("release-gives-a-half-open-permit-back", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), ("acquire", 14.0, False), ("release", 14.5),
        ("acquire", 14.5, True), ("acquire", 14.5, False),
    ]),
    ("release-never-makes-more-than-half-open-calls-permits", {}, [
        *HALF_OPEN_AT_14, ("release", 14.0), ("release", 14.0), *acquires(3, 14.0), ("acquire", 14.0, False),
    ]),
    ("a-released-probe-is-replaced-before-the-verdict", {}, [
        *HALF_OPEN_AT_14, *acquires(3, 14.0), ("release", 14.1), *oks(2, 14.2), ("state", 14.2, HALF),
        ("acquire", 14.3, True), ("ok", FAST, 14.4), ("state", 14.4, CLOSED),
    ]),
    ("release-while-closed-changes-nothing", {}, [
        ("release", 0.0), ("acquire", 0.0, True), *errs(4, 0.0), ("release", 0.0), ("calls", 0.0, 4),
        ("state", 0.0, CLOSED), ("events", []),
    ]),
    ("window-expiry-forgets-old-slow-calls", {"minimum_calls": 11}, [
        *oks(10, 0.0, SLOW, dt=0.1), ("state", 1.0, CLOSED), ("calls", 1.0, 10),
        *oks(10, 12.0), ("calls", 12.0, 10), ("rates", 12.0, -1.0, -1.0),
        ("ok", FAST, 12.0), ("state", 12.0, CLOSED), ("rates", 12.0, 0.0, 0.0),
    ]),
    ("window-keeps-calls-younger-than-window-s", {"minimum_calls": 11}, [
        *oks(10, 0.0, SLOW, dt=0.1), ("state", 1.0, CLOSED), ("calls", 5.0, 10),
        ("ok", FAST, 5.0), ("state", 5.0, OPEN),  # 10 slow of 11 calls
    ]),
    ("a-call-leaves-the-window-when-its-age-reaches-window-s", {}, [
        *errs(4, 0.0), ("calls", 9.999, 4), ("calls", 10.0, 0), ("err", FAST, 10.0), ("state", 10.0, CLOSED),
    ]),
    ("max-half-open-s-without-outcomes-renews-the-permits", {"max_half_open_s": 5.0, "half_open_calls": 1}, [
        *HALF_OPEN_AT_14, ("acquire", 14.0, True), ("acquire", 18.999, False), ("state", 19.0, HALF),
        ("acquire", 19.0, True), ("events", TRIPPED),  # an idle (or cancelled) probe proves nothing
    ]),
    ("max-half-open-s-judges-the-probes-that-came-good", {"max_half_open_s": 5.0}, [
        *HALF_OPEN_AT_14, ("acquire", 14.0, True), ("ok", FAST, 15.0), ("state", 18.999, HALF),
        ("state", 19.0, CLOSED), ("events", [*TRIPPED, (HALF, CLOSED)]),
    ]),
    ("max-half-open-s-judges-the-probes-that-came-bad", {"max_half_open_s": 5.0}, [
        *HALF_OPEN_AT_14, ("acquire", 14.0, True), ("err", FAST, 15.0), ("state", 19.0, OPEN),
        ("acquire", 28.999, False), ("acquire", 29.0, True), ("events", [*TRIPPED, (HALF, OPEN), (OPEN, HALF)]),
    ]),
    ("max-half-open-s-zero-waits-for-the-verdict", {}, [
        *HALF_OPEN_AT_14, ("acquire", 14.0, True), ("state", 10_000.0, HALF), ("events", TRIPPED),
    ]),
    ("minimum-calls-one-opens-on-the-first-failure", {"minimum_calls": 1}, [
        ("ok", FAST, 0.0), ("state", 0.0, CLOSED), ("err", FAST, 1.0), ("state", 1.0, OPEN),  # 1/2 >= 0.3
    ]),
    ("force-open-and-reset-report-once-each", {}, [
        ("force_open", 1.0), ("state", 1.0, OPEN), ("acquire", 10.9, False), ("force_open", 10.9),  # restarts
        ("acquire", 20.8, False), ("state", 20.9, HALF), ("reset", 21.0), ("reset", 22.0), ("state", 22.0, CLOSED),
        ("events", [*TRIPPED, (HALF, CLOSED)]),
    ]),
    ("reads-never-report-a-no-op", {}, [
        *OPENED_AT_4, *[("state", t, OPEN) for t in (5.0, 6.0, 7.0)], *[("state", t, HALF) for t in (14.0, 15.0, 16.0)],
        ("events", TRIPPED),
    ]),
]


def run(cfg: BreakerConfig, steps: Sequence[Step]) -> tuple[CircuitBreaker, list[tuple[str, State, State]]]:
    events: list[tuple[str, State, State]] = []
    cb = CircuitBreaker("llm", cfg, lambda name, old, new: events.append((name, old, new)))
    for i, step in enumerate(steps):
        where = f"step {i}: {step!r}"
        match step:
            case ("ok", duration, t):
                cb.on_success(duration, t)
            case ("err", duration, t):
                cb.on_error(duration, t)
            case ("acquire", t, want):
                assert cb.try_acquire(t) is want, where
            case ("release", t):
                cb.release(t)
            case ("state", t, want):
                assert cb.state(t) is want, where
            case ("calls", t, want):
                assert cb.calls(t) == want, where
            case ("rates", t, failure, slow):
                assert (cb.failure_rate(t), cb.slow_call_rate(t)) == pytest.approx((failure, slow)), where
            case ("force_open", t):
                cb.force_open(t)
            case ("reset", t):
                cb.reset(t)
            case ("events", want):
                assert [(old, new) for _, old, new in events] == want, where
            case _:
                raise AssertionError(f"unknown {where}")
    return cb, events


@pytest.mark.parametrize(("overrides", "steps"), [row[1:] for row in SCENARIOS], ids=[row[0] for row in SCENARIOS])
def test_scenario(overrides: dict[str, Any], steps: list[Step]) -> None:
    _, events = run(BreakerConfig(**overrides), steps)
    assert all(name == "llm" for name, _, _ in events)


def test_scenario_ids_are_unique() -> None:
    assert len({row[0] for row in SCENARIOS}) == len(SCENARIOS) >= 20


@pytest.mark.parametrize(
    "overrides",
    [
        {"window_s": 0.0}, {"window_s": float("inf")}, {"slow_call_s": -1.0}, {"open_s": float("nan")},
        {"max_half_open_s": -0.5}, {"slow_call_rate": 0.0}, {"failure_rate": 1.5}, {"failure_rate": float("nan")},
        {"minimum_calls": 0}, {"half_open_calls": 0}, {"minimum_calls": 2.5}, {"half_open_calls": True},
    ],
    ids=repr,
)
def test_config_rejects_bad_values(overrides: dict[str, Any]) -> None:
    (field,) = overrides
    with pytest.raises(ValueError, match=field):
        BreakerConfig(**overrides)


def test_config_defaults() -> None:
    cfg = BreakerConfig()
    assert (cfg.window_s, cfg.slow_call_s, cfg.slow_call_rate, cfg.failure_rate) == (10.0, 1.0, 0.5, 0.3)
    assert (cfg.minimum_calls, cfg.open_s, cfg.half_open_calls, cfg.max_half_open_s) == (5, 10.0, 3, 0.0)
    assert [s.value for s in State] == ["closed", "open", "half_open"]


# Properties over random sequences. Ops: (kind, dt, duration): the clock advances by dt
# seconds, then the breaker is asked to acquire, told an outcome lasting `duration`, or released.
KINDS = ("acquire", "ok", "err", "release", "state")
Op = tuple[str, float, float]


def check_invariants(cfg: BreakerConfig, ops: Sequence[Op]) -> None:
    """Replays ops against a reference model of the CLOSED window; checks that the breaker opens
    from CLOSED exactly when the model's window holds >= minimum_calls and crosses a rate, that
    half-open permits never exceed half_open_calls, and that transitions chain."""
    events: list[tuple[State, State]] = []
    cb = CircuitBreaker("x", cfg, lambda _, old, new: events.append((old, new)))
    model: list[tuple[float, bool, bool]] = []  # outcomes recorded while CLOSED, since it last closed
    permits = 0
    now = 0.0
    period = cb.since
    for kind, dt, duration in ops:
        now += dt
        before = cb.state(now)
        if before is HALF and cb.since != period:  # a new half-open period: fresh permits
            permits = 0
        period = cb.since
        seen = len(events)
        if before is not CLOSED:
            model.clear()
        model[:] = [(t, s, f) for t, s, f in model if now - t < cfg.window_s]
        if before is CLOSED:
            assert cb.calls(now) == len(model)
        if kind == "acquire":
            got = cb.try_acquire(now)
            assert got is (before is CLOSED or (before is HALF and permits < cfg.half_open_calls))
            permits += got and before is HALF
        elif kind == "release":
            cb.release(now)
            permits = max(0, permits - 1) if before is HALF else permits
        elif kind in ("ok", "err"):
            (cb.on_error if kind == "err" else cb.on_success)(duration, now)
            if before is CLOSED:
                model.append((now, duration > cfg.slow_call_s, kind == "err"))
                calls, slow, failed = len(model), sum(s for _, s, _ in model), sum(f for _, _, f in model)
                crossed = calls >= cfg.minimum_calls and (
                    failed / calls >= cfg.failure_rate or slow / calls >= cfg.slow_call_rate
                )
                assert cb.state(now) is (OPEN if crossed else CLOSED)
                assert events[seen:] == ([(CLOSED, OPEN)] if crossed else [])
        after = cb.state(now)
        if after is not HALF or before is not HALF or cb.since != period:
            permits = 0
        period = cb.since
        assert 0 <= permits <= cfg.half_open_calls
    final = cb.state(now)
    assert all(old is not new for old, new in events)
    assert [old for old, _ in events] == [CLOSED, *(new for _, new in events)][: len(events)]
    assert (events[-1][1] if events else CLOSED) is final


def random_ops(rng: random.Random, n: int) -> list[Op]:
    return [(rng.choice(KINDS), rng.choice((0.0, 0.0, 0.5, 1.0, 3.0, 11.0)), rng.choice((0.1, 1.0, 2.0)))
            for _ in range(n)]


@pytest.mark.parametrize("seed", range(200))
def test_invariants_on_seeded_random_sequences(seed: int) -> None:
    rng = random.Random(seed)
    cfg = BreakerConfig(minimum_calls=rng.randint(1, 6), half_open_calls=rng.randint(1, 4),
                        max_half_open_s=rng.choice((0.0, 5.0)), open_s=rng.choice((1.0, 10.0)))
    check_invariants(cfg, random_ops(rng, 120))


if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    configs = st.builds(
        BreakerConfig,
        window_s=st.sampled_from([1.0, 5.0, 10.0]),
        slow_call_rate=st.sampled_from([0.2, 0.5, 1.0]),
        failure_rate=st.sampled_from([0.1, 0.3, 0.5, 1.0]),
        minimum_calls=st.integers(1, 8),
        open_s=st.sampled_from([0.5, 2.0, 10.0]),
        half_open_calls=st.integers(1, 4),
        max_half_open_s=st.sampled_from([0.0, 3.0]),
    )
    ops = st.lists(
        st.tuples(st.sampled_from(KINDS), st.sampled_from([0.0, 0.25, 1.0, 4.0, 12.0]), st.sampled_from([0.5, 3.0])),
        max_size=80,
    )

    @settings(max_examples=300, deadline=None)
    @given(cfg=configs, ops=ops)
    def test_never_opens_below_minimum_calls_and_transitions_chain(cfg: BreakerConfig, ops: list[Op]) -> None:
        check_invariants(cfg, ops)

    @settings(max_examples=200, deadline=None)
    @given(minimum=st.integers(1, 10), outcomes=st.lists(st.booleans(), max_size=30))
    def test_a_burst_within_the_window_opens_only_once_minimum_calls_are_in(minimum: int, outcomes: list[bool]) -> None:
        cb = CircuitBreaker("x", BreakerConfig(minimum_calls=minimum, failure_rate=1e-9))
        for i, failed in enumerate(outcomes, start=1):
            (cb.on_error if failed else cb.on_success)(FAST, 0.0)
            assert cb.state(0.0) is (OPEN if i >= minimum and any(outcomes[:i]) else CLOSED)
            if cb.state(0.0) is OPEN:
                break
else:  # pragma: no cover - hypothesis is not among the test extras yet

    @pytest.mark.skip(reason="hypothesis is not installed; the seeded random test checks the same invariants")
    def test_hypothesis_properties() -> None: ...
