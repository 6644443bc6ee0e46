"""The degradation policies without a server: fault rules, the out-of-memory ladder, SLO
adaptation, the governor's refusals and turn policy (injected clocks), and a batch worker
that runs out of memory (a scripted stage: this is about orchestration alone)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pipeline.config import DegradeConfig, VoxpipeConfig
from pipeline.errors import Busy
from pipeline.fault_rules import FaultRule, parse_rules
from pipeline.serving.breaker import State
from pipeline.serving.faults import FaultInjector, InjectedFault, InjectedOom
from pipeline.serving.governor import Governor
from pipeline.serving.ladder import OomLadder, is_oom
from pipeline.serving.slo_adapt import SloAdapter, p95
from pipeline.worker import BatchWorker

# ---- fault rules --------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "rule"), [
    ("llm:oom", FaultRule("llm", "oom")),
    ("asr:error@3x2", FaultRule("asr", "error", first=3, count=2)),
    ("tts:slow:2000@1x*", FaultRule("tts", "slow", slow_ms=2000, count=None)),
    (" llm:slow:5x4 ", FaultRule("llm", "slow", slow_ms=5, count=4)),
])
def test_fault_rules_parse(text, rule):
    assert FaultRule.parse(text) == rule


@pytest.mark.parametrize("text", ["gpu:oom", "llm:crash", "llm:oom@0", "llm:oom@1x0", "llm:slow", "llm:slow:x",
                                  "llm:oom@1x2y", ""])
def test_bad_fault_rules_are_refused_with_the_syntax(text):
    with pytest.raises(ValueError, match="bad fault rule"):
        FaultRule.parse(text)


def test_a_bad_rule_is_a_configuration_error():
    cfg = VoxpipeConfig()
    cfg.degrade = DegradeConfig(faults=("llm:oom@1x2", "tts:nonsense"))
    with pytest.raises(ValueError, match="nonsense"):
        cfg.validate()


def test_injector_counts_calls_after_arming_and_hits_exactly_the_named_ones():
    slept: list[float] = []
    inj = FaultInjector(parse_rules(["llm:oom@2x2, tts:slow:50@1x*; asr:error@3"]), sleep=slept.append)
    inj.hit("llm")  # not armed yet (warm-up): not counted
    inj.arm()
    outcomes = []
    for _ in range(5):
        try:
            inj.hit("llm")
            outcomes.append("ok")
        except InjectedOom:
            outcomes.append("oom")
    assert outcomes == ["ok", "oom", "oom", "ok", "ok"]
    for _ in range(3):
        inj.hit("tts")
    assert slept == [0.05, 0.05, 0.05]
    inj.hit("asr")
    inj.hit("asr")
    with pytest.raises(InjectedFault):
        inj.hit("asr")
    inj.clear()
    inj.hit("asr")  # cleared: nothing any more
    inj.hit("llm")


def test_an_injector_without_rules_never_acts():
    inj = FaultInjector()
    assert not inj.active
    for stage in ("asr", "llm", "tts"):
        inj.hit(stage)


@pytest.mark.parametrize(("exc", "oom"), [
    (MemoryError(), True), (InjectedOom("x"), True), (RuntimeError("CUDA out of memory. Tried to allocate"), True),
    (RuntimeError("std::bad_alloc"), True),
    (RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Failed to allocate memory for requested buffer"), True),
    (RuntimeError("shape mismatch"), False), (ValueError("out of memory"), False), (InjectedFault("x"), False),
])
def test_is_oom_knows_the_runtimes_allocation_failures(exc, oom):
    assert is_oom(exc) is oom


def test_is_oom_knows_torch_out_of_memory_error():
    torch = pytest.importorskip("torch")
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory"))


# ---- the ladder ---------------------------------------------------------------------------


def test_ladder_climbs_one_step_per_oom_and_calms_down_one_step_per_calm_period():
    moves: list[tuple[str, int, int]] = []
    ladder = OomLadder("llm", max_step=3, calm_s=60, on_transition=lambda *m: moves.append(m))
    assert ladder.oom(0.0) == 1 and not ladder.refusing
    assert ladder.oom(1.0) == 2 and ladder.refusing and ladder.batch_size(8) == 4
    assert ladder.oom(2.0) == 3 and not ladder.refusing
    assert ladder.oom(3.0) == 3  # the top: no transition
    assert ladder.tick(62.9) == 3  # the last OOM is 59.9 s ago
    assert ladder.tick(63.0) == 2 and not ladder.refusing  # on the way down, step 2 refuses nothing
    assert ladder.batch_size(8) == 4
    assert ladder.tick(100.0) == 2 and ladder.tick(123.0) == 1 and ladder.tick(183.0) == 0
    assert ladder.tick(1000.0) == 0 and ladder.batch_size(8) == 8
    assert moves == [("llm", 0, 1), ("llm", 1, 2), ("llm", 2, 3), ("llm", 3, 2), ("llm", 2, 1), ("llm", 1, 0)]


def test_an_oom_at_the_top_of_a_two_step_ladder_refuses_again():
    ladder = OomLadder("asr", max_step=2, calm_s=10)
    ladder.oom(0.0)
    ladder.oom(0.0)
    ladder.tick(10.0)
    ladder.tick(20.0)
    assert ladder.step == 0
    ladder.oom(30.0)
    ladder.oom(31.0)
    ladder.tick(41.0)  # down to 1
    ladder.oom(42.0)  # climbing to 2 again
    assert ladder.step == 2 and ladder.refusing


# ---- SLO adaptation -----------------------------------------------------------------------


def test_p95_is_the_nearest_rank():
    assert p95([1.0]) == 1.0
    assert p95(list(range(1, 21))) == 19
    assert p95(list(range(1, 101))) == 95
    with pytest.raises(ValueError):
        p95([])


def test_slo_adapter_steps_up_in_order_and_back_down_when_under_for_a_while():
    moves = []
    d = DegradeConfig(adapt_min_samples=5, adapt_up_s=5, adapt_down_s=20, adapt_window_s=60)
    a = SloAdapter(2000, d, max_level=2, on_transition=lambda *m: moves.append(m[:2]))
    t = 0.0
    for _ in range(4):
        t += 1
        assert a.observe(3000, t) == 0  # fewer than 5 samples: no judgement
    assert a.observe(3000, 5.0) == 1
    for i in range(5):  # samples before the change no longer count: 5 new ones over the SLO ...
        assert a.observe(3000, 6.0 + i * 0.5) == (1 if i < 4 else 1)  # ... but the last change is < 5 s ago
    assert a.observe(3000, 10.0) == 2  # the sample that changed it does not count after the change
    for i in range(5):
        a.observe(900, 12.0 + i)  # under 0.8 x SLO
    assert a.tick(29.9) == 2 and a.tick(30.0) == 1
    a.observe(900, 31.0)
    assert a.tick(55.0) == 1  # too few samples since the change: no evidence either way, it holds
    assert a.tick(90.9) == 1 and a.tick(91.0) == 0  # no turn for the whole window (60 s): idle, down
    assert moves == [(0, 1), (1, 2), (2, 1), (1, 0)]


def test_slo_adapter_holds_between_restore_and_the_slo():
    a = SloAdapter(2000, DegradeConfig(adapt_min_samples=5, adapt_up_s=0, adapt_down_s=10), max_level=1)
    for i in range(5):
        a.observe(2500, float(i))
    assert a.level == 1
    for i in range(10):
        a.observe(1800, 5.0 + i)  # over 0.8 x 2000, under 2000: neither up nor down
    assert a.tick(30.0) == 1


# ---- the governor ---------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def governor(fallback: bool = True, **degrade) -> tuple[Governor, Clock]:
    cfg = VoxpipeConfig()
    cfg.degrade = DegradeConfig(**degrade)
    clock = Clock()
    return Governor(cfg, fallback=fallback, faults=FaultInjector(), clock=clock), clock


def test_ladder_step_2_refuses_every_turn_and_step_3_moves_new_turns_to_the_fallback():
    g, clock = governor()
    assert g.refusal(spoken=True) is None and g.conditions() == []
    g.ladders["llm"].oom(clock.t)
    assert g.refusal(spoken=False) is None
    g.ladders["llm"].oom(clock.t)
    busy = g.refusal(spoken=False)
    assert isinstance(busy, Busy) and busy.reason == "ladder"
    g.ladders["llm"].oom(clock.t)
    assert g.refusal(spoken=True) is None
    assert g.turn_policy().fallback
    (cond,) = g.conditions()
    assert (cond.source, cond.stage, cond.level) == ("ladder", "llm", "3")


def test_an_open_asr_breaker_refuses_spoken_turns_only():
    g, clock = governor(breaker_min_calls=4)
    for _ in range(4):
        g.guards["asr"].record(0.01, True)
    assert g.guards["asr"].state() is State.OPEN
    busy = g.refusal(spoken=True)
    assert busy is not None and busy.reason == "breaker" and busy.retry_after_ms >= 500
    assert g.refusal(spoken=False) is None
    clock.t += 10.0  # open 10 s, then half-open: probes may pass
    assert g.refusal(spoken=True) is None


@pytest.mark.parametrize(("fallback", "opens", "expect"), [
    (True, 1, "short"), (True, 2, "fallback"), (True, 3, "stock"),
    (False, 1, "short"), (False, 2, "stock"),
])
def test_an_open_llm_breaker_degrades_step_by_step(fallback, opens, expect):
    g, clock = governor(fallback=fallback, breaker_min_calls=4, breaker_probes=1)
    for n in range(opens):
        for _ in range(4 if n == 0 else 1):  # the first opening fills the window; then one failed probe
            g.guards["llm"].record(0.01, True)
        assert g.guards["llm"].state() is State.OPEN
        if n < opens - 1:
            clock.t += 10.0  # half-open
            assert g.guards["llm"].state() is State.HALF_OPEN
    p = g.turn_policy()
    if expect == "short":
        assert p.max_new_tokens == g.d.short_reply_tokens and not p.fallback and p.stock_line is None
    elif expect == "fallback":
        assert p.fallback and p.stock_line is None
    else:
        assert p.stock_line == g.d.stock_line


def test_slo_levels_shorten_replies_then_use_the_fallback():
    g, clock = governor(adapt_min_samples=5, adapt_up_s=5)
    normal = g.turn_policy()
    for _ in range(5):
        g.observe_v2v(10_000)
    one = g.turn_policy()
    assert one.max_new_tokens < normal.max_new_tokens and one.context_tokens < normal.context_tokens
    assert not one.fallback
    clock.t += 5
    for _ in range(5):
        g.observe_v2v(10_000)
    assert g.turn_policy().fallback
    assert [c.source for c in g.conditions()] == ["slo"]


def test_every_transition_reaches_subscribers_once_per_change():
    g, clock = governor()
    seen: list[list] = []
    unsubscribe = g.subscribe(seen.append)
    g.tick()
    assert seen == []  # nothing changed
    g.ladders["tts"].oom(clock.t)
    g.tick()
    g.tick()
    assert len(seen) == 1 and seen[0][0].stage == "tts"
    clock.t += 60.0
    g.tick()
    assert seen[-1] == [] and len(seen) == 2
    unsubscribe()
    g.ladders["tts"].oom(clock.t)
    g.tick()
    assert len(seen) == 2


# ---- a batch worker that runs out of memory (scripted stage) ------------------------------------


class Scripted(BatchWorker[int, int]):
    """Doubles its items; raises MemoryError for the first ``ooms`` batches."""

    def __init__(self, ooms: int, batch: int = 4) -> None:
        super().__init__("asr", queue_size=64, max_batch_size=batch, max_wait_ms=200)
        self.ooms, self.batches, self.freed = ooms, [], 0
        self.gate = threading.Event()

    def process_batch(self, items):
        self.gate.wait(10)
        if self.ooms:
            self.ooms -= 1
            raise MemoryError("scripted")
        self.batches.append(list(items))
        return [2 * i for i in items]

    def free_memory(self) -> None:
        self.freed += 1


@pytest.mark.parametrize(("ooms", "step"), [(1, 1), (2, 2)])
async def test_a_worker_retries_a_batch_that_ran_out_of_memory_and_requeues_the_newest(ooms, step):
    w = Scripted(ooms)
    w.ladder = OomLadder("asr", max_step=2, calm_s=60)
    w.start()
    try:
        futs = [w.submit(i) for i in range(4)]
        w.gate.set()
        assert await asyncio.wait_for(asyncio.gather(*futs), 30) == [0, 2, 4, 6]  # every item answered
        assert w.ladder.step == step and w.freed == ooms
        if step == 2:  # halved: the two newest went back to the queue and ran in the next batch
            assert w.batches == [[0, 1], [2, 3]]
        else:
            assert w.batches == [[0, 1, 2, 3]]
    finally:
        w.stop()


async def test_a_worker_gives_up_after_the_retries_and_fails_only_that_batch():
    w = Scripted(ooms=99, batch=1)
    w.ladder = OomLadder("asr", max_step=2, calm_s=60)
    w.gate.set()
    w.start()
    try:
        with pytest.raises(MemoryError):
            await asyncio.wait_for(w.submit(1), 30)
        w.ooms = 0
        assert await asyncio.wait_for(w.submit(2), 30) == 4  # the stage lives on
    finally:
        w.stop()


# ---- configuration errors: clear, at start ----------------------------------------------------


@pytest.mark.parametrize("field", ["ladder_calm_s", "breaker_open_s", "adapt_down_s", "breaker_window_s"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_degrade_durations_must_be_finite_and_positive(field, value):
    cfg = VoxpipeConfig()
    cfg.degrade = DegradeConfig(**{field: value})
    with pytest.raises(ValueError, match=field):
        cfg.validate()


def test_breaker_slow_times_must_be_finite_and_positive():
    for bad in ({"tts": float("nan")}, {"asr": 0.0}, {"gpu": 5.0}):
        cfg = VoxpipeConfig()
        cfg.degrade = DegradeConfig(breaker_slow_ms=bad)
        with pytest.raises(ValueError, match="breaker_slow_ms"):
            cfg.validate()


@pytest.mark.parametrize(("args", "env", "message"), [
    (["--ladder-calm-s", "inf"], None, "ladder_calm_s"),
    (["--breaker-open-s", "nan"], None, "breaker_open_s"),
    (["--fallback-llm", "/nonexistent"], None, "--fallback-llm"),
    (["--fault", ""], None, "empty fault rule"),
    ([], " , ; ", "VOXPIPE_FAULTS"),
    ([], "llm:explode", "VOXPIPE_FAULTS"),
])
def test_serve_refuses_bad_degrade_settings_before_loading_anything(args, env, message):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    environ = {k: v for k, v in os.environ.items() if k != "VOXPIPE_FAULTS"}
    if env is not None:
        environ["VOXPIPE_FAULTS"] = env
    r = subprocess.run([sys.executable, "-m", "cli", "serve", "--port", "1", *args], cwd=ROOT, env=environ,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "bad configuration" in r.stderr and message in r.stderr
    assert "Traceback" not in r.stderr


def test_an_asr_ladder_at_step_2_refuses_spoken_turns_only_and_says_when_to_retry():
    g, clock = governor()
    g.ladders["asr"].oom(clock.t)
    g.ladders["asr"].oom(clock.t)
    clock.t += 20.0
    busy = g.refusal(spoken=True)
    assert busy is not None and busy.reason == "ladder" and 39_000 <= busy.retry_after_ms <= 40_000
    assert g.refusal(spoken=False) is None  # a typed turn needs no ASR


def test_an_idle_half_open_breaker_neither_reopens_nor_escalates_the_llm_policy():
    g, clock = governor(breaker_min_calls=4)
    for _ in range(4):
        g.guards["llm"].record(0.01, True)
    clock.t += 10.0
    assert g.guards["llm"].state() is State.HALF_OPEN
    for _ in range(6):  # a minute with no LLM call at all
        clock.t += 10.0
        g.tick()
    assert g.guards["llm"].state() is State.HALF_OPEN and g.llm_opens == 1
    assert g.turn_policy().stock_line is None
    g.guards["llm"].record(0.01, False)  # one good probe; the period times out: judged on what came
    clock.t += 10.0
    assert g.guards["llm"].state() is State.CLOSED and g.llm_opens == 0
