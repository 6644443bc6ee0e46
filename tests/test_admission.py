"""Admission against the latency SLO: the pure policy (scripted loads), and a session on
fakes refusing a turn before any model work is spent on it. No models, no wall clock."""

from __future__ import annotations

import math
import threading

import pytest

from pipeline.config import AdmissionConfig, TurnConfig, VoxpipeConfig
from pipeline.serving.admission import Admission, Ewma, Load, Prediction, RatioQuantile
from pipeline.serving.types import StageLoad
from pipeline.session import events as ev
from tests.fakes import Delta, FakeAsr, FakeLlm, LlmReply, fake_engines, silence, tone
from tests.session_harness import Audio, Cancel, Harness, Start, Text, WaitFor, WaitUntil

IDLE = Load()


def policy(**cfg) -> Admission:
    return Admission(AdmissionConfig(**cfg))


def test_the_load_reads_urgent_asr_and_tts_work_and_the_whole_llm_snapshot():
    asr, tts = StageLoad(depth=5, urgent_depth=2), StageLoad(depth=4, urgent_depth=1)
    llm = StageLoad(depth=3, urgent_depth=3, active=4, slots=8, kv_reserved=100, kv_budget=1000, step_ms=12.5)
    assert Load.of(asr, llm, tts, asr_batch=6, tts_workers=2) == Load(
        asr_waiting=2, asr_batch=6, llm_waiting=3, llm_running=4, llm_slots=8, kv_reserved=100, kv_budget=1000,
        llm_step_ms=12.5, tts_waiting=1, tts_workers=2)
    fake = FakeLlm()
    fake.depth = 7
    engines, cfg = fake_engines(llm=fake), VoxpipeConfig()
    assert engines.load(cfg) == Load.of(StageLoad(), fake.load(), StageLoad(), asr_batch=cfg.asr.max_batch_size,
                                        tts_workers=cfg.tts.workers)
    assert engines.load(cfg).llm_waiting == 7 and engines.loads()["llm"].depth == 7


def test_an_idle_server_admits_a_turn_and_predicts_the_sum_of_its_stages():
    a = policy(prior_asr_ms=100, prior_llm_step_ms=40, prior_tts_ms=120, first_phrase_tokens=8, prefill_steps=2)
    assert a.predict_ms(IDLE, spoken=True, end_silence_ms=500) == pytest.approx(500 + 100 + 10 * 40 + 120)
    assert a.predict_ms(IDLE, spoken=False, end_silence_ms=500) == pytest.approx(10 * 40 + 120)
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1024, now=0.0) is None
    assert (a.admitted, a.refused) == (1, 0)


def test_a_full_batch_with_a_queue_behind_it_is_refused_with_a_retry_hint():
    a = policy(slo_ms=2000, prior_llm_step_ms=50, prior_reply_tokens=30)
    full = Load(llm_running=8, llm_slots=8, llm_waiting=8)
    refusal = a.decide(full, spoken=True, end_silence_ms=500, kv_tokens=1024, now=0.0)
    assert refusal is not None and refusal.reason == "queue"
    # two rounds of slot waits (8 ahead + this one, 8 slots) of 30 tokens × 50 ms each
    assert refusal.predicted_ms >= 2 * 30 * 50
    assert refusal.retry_after_ms >= refusal.predicted_ms - 2000 and refusal.retry_after_ms % 100 == 0
    assert (a.admitted, a.refused) == (0, 1)


def test_prediction_grows_with_every_queue():
    a = policy()
    base = a.predict_ms(IDLE, spoken=True, end_silence_ms=500)
    for load in (Load(asr_waiting=8), Load(llm_running=8, llm_waiting=0), Load(tts_waiting=1),
                 Load(llm_step_ms=200.0)):
        assert a.predict_ms(load, spoken=True, end_silence_ms=500) > base, load


def test_a_free_slot_means_no_slot_wait():
    a = policy()
    assert a.predict_ms(Load(llm_running=7, llm_waiting=0), spoken=False, end_silence_ms=0) == \
        a.predict_ms(IDLE, spoken=False, end_silence_ms=0)


def test_a_full_kv_budget_refuses_with_reason_memory_but_a_lone_request_always_runs():
    a = policy()
    tight = Load(llm_running=2, kv_reserved=3000, kv_budget=4000)
    refusal = a.decide(tight, spoken=False, end_silence_ms=0, kv_tokens=1024, now=0.0)
    assert refusal is not None and refusal.reason == "memory"
    assert a.decide(Load(llm_running=0, kv_reserved=0, kv_budget=100), spoken=False, end_silence_ms=0,
                    kv_tokens=1024, now=0.0) is None


def test_an_idle_but_slow_server_admits_the_turn_anyway():
    a = policy(slo_ms=2000)
    slow = Load(llm_step_ms=1000.0)  # every queue empty, a free slot: refusing cannot help anyone
    assert a.predict_ms(slow, spoken=True, end_silence_ms=500) > 2000
    assert a.decide(slow, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0) is None


def test_a_burst_of_turns_ending_together_counts_the_ones_admitted_before_it():
    a = policy(slo_ms=2000, prior_llm_step_ms=50, prior_reply_tokens=30)
    keys = [object() for _ in range(16)]
    decisions = [a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, key=k) for k in keys]
    admitted = [k for k, d in zip(keys, decisions, strict=True) if d is None]
    assert 0 < len(admitted) < 16 and a.pending(0.0) == len(admitted)
    assert all(d is None for d in decisions[: len(admitted)])  # first come, first admitted
    for k in admitted:
        a.release(k)
    assert a.pending(0.0) == 0
    assert a.critical(0.0) == len(admitted)  # queued for the LLM, but their users still wait
    for k in admitted:
        a.observe(k, 800.0, now=0.5)  # first audio, within the SLO
    assert a.critical(0.5) == 0
    assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.5) is None


def test_the_concurrency_limit_shrinks_on_a_miss_and_grows_back_on_hits():
    a = policy(slo_ms=2000, initial_limit=4.0, limit_backoff=0.5)
    busy = Load(llm_running=1)  # not idle
    keys = [object() for _ in range(4)]
    for k in keys:
        assert a.decide(busy, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, key=k) is None
    refusal = a.decide(busy, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0)
    assert refusal is not None and "limit 4" in refusal.message  # 4 users already wait
    a.observe(keys[0], 3000.0, now=1.0)  # a miss: 4 → 2
    a.observe(keys[1], 3000.0, now=1.5)  # another miss within the same SLO period: no second cut
    assert a.limit == 2.0
    assert a.decide(busy, spoken=False, end_silence_ms=0, kv_tokens=1, now=1.5) is not None  # 2 wait, limit 2
    a.observe(keys[2], 900.0, now=2.0)  # a hit: +1/limit
    assert a.limit == 2.5
    a.observe(keys[3], 900.0, now=2.0)
    a.correction = RatioQuantile(q=0.9)  # (forget the misses' lesson: the correction is another test's subject)
    for i in range(20):  # two users at a time: the limit grows while that is at least half of it
        pair = [f"hit{i}a", f"hit{i}b"]
        for k in pair:
            assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=20.0, key=k) is None
        for k in pair:
            a.release(k)
            a.observe(k, 900.0, now=20.0)
    assert 4.0 < a.limit < 4.5  # about +1 per limit's worth of hits, then no more: 2 of 4+ proves nothing
    before = a.limit
    for i in range(10):  # one at a time: hits, but the limit was not in use
        assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=25.0, key=f"alone{i}") is None
        a.release(f"alone{i}")
        a.observe(f"alone{i}", 900.0, now=25.0)
    assert a.limit == before
    assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=30.0, key="miss") is None
    a.release("miss")
    a.observe("miss", 2500.0, now=30.0)  # a surprising miss: halved
    assert a.limit == before * 0.5
    a.limit = 1.2
    assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=40.0, key="floor") is None
    a.release("floor")
    a._predicted["floor"] = Prediction(650.0, 0.0, 100.0, False, True)  # (as predicted on time)
    a.observe("floor", 2500.0, now=40.0)
    assert a.limit == 1.0  # never below one turn at a time
    a.limit = 4.0
    assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=50.0, key="near") is None
    a.release("near")
    a._predicted["near"] = Prediction(650.0, 0.0, 100.0, False, True)
    a.observe("near", 1800.0, now=50.0)  # within the SLO, but past its headroom (0.85 × 2000): back off
    assert a.limit == 2.0
    assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=500.0) is None  # idle: admitted


def test_the_correction_is_a_high_quantile_of_the_ratios():
    from pipeline.serving.admission import RatioQuantile

    r = RatioQuantile(q=0.9)
    assert r.value == 1.0
    r.add(2.0)
    r.add(float("nan"))
    r.add(-1.0)
    assert r.value == 2.0  # a mean until enough are known; bad samples ignored
    for i in range(100):
        r.add(1.0 + (i % 10) / 10)  # 1.0 .. 1.9, evenly
    assert r.value == 1.9  # the tail, not the mean (1.45)


def test_a_pending_turn_that_is_never_released_expires():
    a = policy(pending_ttl_s=10.0)
    a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=100.0, key="turn")
    assert a.pending(105.0) == 1 and a.pending(110.5) == 0


def test_disabled_admission_admits_everything():
    a = policy(enabled=False)
    assert a.decide(Load(llm_running=8, llm_waiting=100), spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0) is None


def test_a_look_ahead_is_not_counted():
    a = policy()
    a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0, count=False)
    assert (a.admitted, a.refused) == (0, 0)


def test_measured_times_replace_the_priors():
    a = policy(prior_llm_step_ms=50)
    before = a.predict_ms(IDLE, spoken=False, end_silence_ms=0)
    for _ in range(50):
        a.times.llm_step.add(200.0)
    assert a.predict_ms(IDLE, spoken=False, end_silence_ms=0) > before * 2


def test_ewma_ignores_samples_that_are_not_times():
    e = Ewma(10.0)
    for bad in (math.nan, math.inf, -1.0):
        e.add(bad)
    assert e.value == 10.0
    e.add(20.0)
    assert 10.0 < e.value < 20.0


# ---- a session on fakes --------------------------------------------------------------


def busy_llm() -> FakeLlm:
    """A fake LLM whose batch is full with a queue behind it (as admission sees it)."""
    llm = FakeLlm(default=LlmReply.of("Sure."))
    llm.active, llm.slots, llm.depth = 8, 8, 16
    return llm


async def test_a_refused_spoken_turn_costs_no_urgent_decode_no_tokenization_and_no_prefill():
    llm, asr = busy_llm(), FakeAsr()
    counted: list[int] = []
    original = llm.count_tokens
    llm.count_tokens = lambda messages: counted.append(1) or original(messages)  # type: ignore[method-assign]
    cfg = VoxpipeConfig()
    cfg.turn = TurnConfig(early_end_ms=200)
    h = Harness(engines=fake_engines(llm=llm, asr=asr), cfg=cfg, admission=Admission(cfg.admission))
    try:
        seen = await h.play([Start(), Audio(tone(1500)), Audio(silence(1000)), WaitFor(ev.Busy),
                             WaitFor(ev.TranscriptFinal)])
        busy = [e for e in seen if isinstance(e, ev.Busy)]
        assert busy[0].reason == "queue" and busy[0].retry_after_ms > 0
        kinds = [type(e) for e in seen]
        # the words come after the busy, unanswered (tests/test_refused_words.py)
        assert kinds.index(ev.SpeechStopped) < kinds.index(ev.Busy) < kinds.index(ev.TranscriptFinal)
        assert ev.ResponseStarted not in kinds
        # no urgent final decode: the refused turn's transcript is decoded behind every other decode
        assert all(r.background for r in asr.requests if getattr(r, "final", False) or getattr(r, "urgent", False))
        assert llm.requests == [] and counted == []  # no prefill, no tokenization
        assert h.admission is not None and (h.admission.admitted, h.admission.refused) == (0, 1)
        # the load passes: the next turn is answered, in the same session
        llm.active = llm.depth = 0
        await h.play([Audio(tone(1500)), Audio(silence(1000)), WaitFor(ev.ResponseDone)])
        assert h.admission.admitted == 1
    finally:
        await h.close()


async def test_a_refused_typed_turn_leaves_the_current_reply_playing():
    llm = FakeLlm(default=LlmReply.of("Sure."))
    cfg = VoxpipeConfig()
    admission = Admission(cfg.admission)
    h = Harness(engines=fake_engines(llm=llm), cfg=cfg, admission=admission)
    try:
        await h.play([Start(), Text("first"), WaitFor(ev.ResponseStarted)])
        llm.active, llm.depth = 8, 16  # the batch fills up behind the first reply
        await h.play([Text("second"), WaitFor(ev.Busy), WaitFor(ev.ResponseDone)])
        assert len(llm.requests) == 1
        assert not [e for e in h.out.seen if isinstance(e, ev.ResponseCancelled)]
    finally:
        await h.close()


async def test_every_started_response_ends_even_when_the_reply_fails():
    llm = FakeLlm([LlmReply([Delta("Half a")], error=RuntimeError("model fell over"))])
    h = Harness(engines=fake_engines(llm=llm))
    try:
        await h.play([Start(), Text("hi"), WaitFor(ev.ResponseCancelled)])
        cancelled = [e for e in h.out.seen if isinstance(e, ev.ResponseCancelled)]
        assert cancelled[0].reason == "error"
        codes = [e.code for e in h.out.seen if isinstance(e, ev.Error)]
        assert codes == ["reply_failed"]
    finally:
        await h.close()


def test_admission_learns_from_turns_that_came_in_later_than_predicted():
    a = policy(slo_ms=2000)
    busy = Load(llm_running=2, llm_waiting=1)  # another user waits for a first token: not idle
    raw = a.predict_ms(busy, spoken=True, end_silence_ms=500)
    assert a.decide(busy, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0) is None
    for i in range(40):  # admitted turns (an idle server admits all) come in at 2.5x their prediction
        key = f"k{i}"
        assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0, key=key) is None
        a.release(key)
        a.observe(key, 2.5 * a.predict_ms(IDLE, spoken=True, end_silence_ms=500))
    assert a.correction.value > 2.0
    refusal = a.decide(busy, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0)
    assert refusal is not None and refusal.reason == "queue" and refusal.predicted_ms > 2 * raw
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0) is None  # idle: still answered


def test_an_unknown_or_expired_turn_teaches_nothing():
    a = policy()
    a.observe("never admitted", 10_000.0)
    a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, key="old")
    a.pending(1000.0)  # long past every expiry
    a.observe("old", 10_000.0)
    assert a.correction.value == 1.0


def test_a_long_prompt_predicts_its_prefill_and_its_miss_shrinks_no_limit():
    a = policy(slo_ms=2000, prior_prefill_ms_per_token=2.0, base_prompt_tokens=192)
    busy = Load(llm_running=1, llm_waiting=1)  # another user waits for a first token
    short = a.predict_ms(busy, spoken=False, end_silence_ms=0, prompt_tokens=100)
    long = a.predict_ms(busy, spoken=False, end_silence_ms=0, prompt_tokens=1000)
    assert long - short == (1000 - 192) * 2.0
    assert a.decide(busy, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, prompt_tokens=100) is None
    refusal = a.decide(busy, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, prompt_tokens=1000)
    assert refusal is not None and refusal.reason == "queue"  # one session's appetite, refused while others run
    limit = a.limit
    assert a.decide(IDLE, spoken=False, end_silence_ms=0, kv_tokens=1, now=10.0, key="heavy",
                    prompt_tokens=1000) is None  # idle: answered anyway
    a.release("heavy")
    a.observe("heavy", 2600.0, now=12.0)  # late, as predicted: no surprise
    assert a.limit >= limit


async def test_a_long_typed_question_is_refused_while_others_are_answered():
    llm = FakeLlm(default=LlmReply.of("Sure."))
    llm.active, llm.slots, llm.depth = 1, 8, 1  # another user waits for a first token: not idle
    cfg = VoxpipeConfig()
    h = Harness(engines=fake_engines(llm=llm), cfg=cfg, admission=Admission(cfg.admission))
    try:
        seen = await h.play([Start(), Text("word " * 1500), WaitFor(ev.Busy)])
        assert [e for e in seen if isinstance(e, ev.Busy)][0].reason == "queue"
        assert llm.requests == []
        await h.play([Text("What time is it?"), WaitFor(ev.ResponseDone)])
    finally:
        await h.close()


def one_at_a_time(llm: FakeLlm) -> tuple[Harness, Admission]:
    """A session on fakes whose admission lets one user wait for a first audio at a time."""
    cfg = VoxpipeConfig()
    cfg.admission = AdmissionConfig(initial_limit=1)
    admission = Admission(cfg.admission)
    return Harness(engines=fake_engines(llm=llm), cfg=cfg, admission=admission), admission


async def test_a_reply_cancelled_before_its_task_ran_gives_its_place_back():
    """``text.input`` then ``response.cancel`` at once: the reply's task is cancelled before
    it ever ran (a cancel/restart without pauses) and must still give its admission place back."""
    llm = FakeLlm(default=LlmReply.of("Sure."))
    h, admission = one_at_a_time(llm)
    try:
        await h.play([Start()])
        for i in range(5):
            await h.play([Text(f"question {i}"), Cancel()])
        await h.play([WaitUntil(lambda: admission.critical(0.0) == 0 and admission.pending(0.0) == 0,
                                "every cancelled turn's place is back")])
        await h.play([Text("What is the capital of France?"), WaitFor(ev.ResponseDone)])
        assert not h.out.events(ev.Busy)
    finally:
        await h.close()


async def test_a_reply_stopped_before_its_response_started_sends_no_response_cancelled():
    """``response.cancelled`` closes a started response; it never names one the client
    was not told about."""
    entered, gate = threading.Event(), threading.Event()

    class SlowPromptLlm(FakeLlm):
        def count_tokens(self, messages: list[dict]) -> int:
            if not entered.is_set():  # the first reply is still building its prompt
                entered.set()
                gate.wait(60)
            return super().count_tokens(messages)

    llm = SlowPromptLlm(default=LlmReply.of("Sure."))
    h = Harness(engines=fake_engines(llm=llm))
    try:
        await h.play([Start(), Text("first"), WaitUntil(entered.is_set, "the first prompt is built"), Cancel(),
                      Text("second"), WaitFor(ev.ResponseDone)])
        assert len(h.out.events(ev.ResponseStarted)) == 1 and not h.out.events(ev.ResponseCancelled)
        assert len(llm.requests) == 1  # the stopped reply never reached the model
    finally:
        gate.set()
        await h.close()


def test_a_turn_does_not_wait_behind_its_own_speculation():
    """A speculation admitted at the pause holds its turn's place; when the turn then ends
    (before the speculation's transcript is back) the server is still idle for it."""
    a = policy(slo_ms=2000, prior_llm_step_ms=400)  # predicted far over the SLO: only idleness admits
    assert a.decide(IDLE, spoken=True, end_silence_ms=300, kv_tokens=1, now=0.0, key="turn", count=False) is None
    assert a.critical(0.0) == 1
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.1, key="turn") is None
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.1, key="another") is not None


def test_a_turn_does_not_wait_behind_its_own_sessions_earlier_turns():
    """The same session's earlier admitted turns (``own``) are not others waiting: the new
    turn's reply replaces theirs. Another session's turn still counts."""
    a = policy(slo_ms=2000, prior_llm_step_ms=400)  # predicted far over the SLO: only idleness admits
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.0, key="first") is None
    assert a.holds("first") and a.critical(0.0) == 1
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.1, key="second") is not None
    assert a.decide(IDLE, spoken=True, end_silence_ms=500, kv_tokens=1, now=0.1, key="second",
                    own=["first"]) is None
    a.forget("first")
    assert not a.holds("first") and a.holds("second")


def test_replies_that_only_play_leave_the_server_idle():
    a = policy(slo_ms=2000)
    playing = Load(llm_running=8, llm_slots=8)  # every slot decodes; nobody waits for a first token
    assert a.corrected_ms(playing, spoken=False, end_silence_ms=0) > 0
    a.limit = 1.0
    assert a.decide(playing, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, key="k") is None
    # but the next one sees that turn waiting for its first audio
    assert a.decide(playing, spoken=False, end_silence_ms=0, kv_tokens=1, now=0.0, key="j") is not None


async def test_a_reply_cancelled_before_its_first_audio_gives_its_place_back():
    """Ten cancel/restart cycles in one session must not fill the concurrency
    limit with turns nobody waits for any more."""
    llm = FakeLlm(default=LlmReply.of("A very", " slow reply.", delay_s=30.0))
    h, admission = one_at_a_time(llm)
    try:
        await h.play([Start()])
        for i in range(3):
            await h.play([Text(f"question {i}"), WaitFor(ev.ResponseStarted, count=i + 1), Cancel(),
                          WaitFor(ev.ResponseCancelled, count=i + 1)])
        assert not h.out.events(ev.Busy)
        assert admission.critical(0.0) == 0 and admission.pending(0.0) == 0
        llm.default = LlmReply.of("Paris.")
        await h.play([Text("What is the capital of France?"), WaitFor(ev.ResponseDone)])
        assert not h.out.events(ev.Busy)
    finally:
        await h.close()
