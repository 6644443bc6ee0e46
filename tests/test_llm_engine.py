"""The LLM engine with the real SmolLM2: streaming, abort, concurrency, context budget,
chunked prefill of long prompts, the shared-prefix cache. Every test loads the model: all
are ``slow`` (tests/test_llm_stream.py covers the engine glue with a tiny model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.errors import Busy
from pipeline.llm.engine import LlmEngine
from pipeline.llm.loader import load_llm
from pipeline.llm.types import FinishReason, GenRequest
from pipeline.session.history import ChatHistory

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return load_llm("smollm2", device="cpu-fp32")


@pytest.fixture(scope="module")
def engine(llm):
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=5))
    eng.start()
    yield eng
    eng.stop()


def ask(text: str, n: int = 24, **kw) -> GenRequest:
    return GenRequest(messages=[{"role": "user", "content": text}], max_new_tokens=n, **kw)


async def collect(stream) -> str:
    return "".join([d async for d in stream])


async def until(cond, timeout_s: float = 300.0) -> None:
    """Wait until ``cond()`` holds; fail after a deadline far beyond any machine's speed."""
    for _ in range(int(timeout_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def test_concurrent_requests_equal_their_solo_runs(engine):
    prompts = ["What is the capital of France?", "Name a color.", "Say hello in French.", "What is 2 plus 2?"]
    solo = [await collect(engine.submit(ask(p))) for p in prompts]
    streams = []
    for p in prompts:
        streams.append(engine.submit(ask(p)))
        await asyncio.sleep(0.05)  # staggered: each joins a running batch
    together = await asyncio.gather(*(collect(s) for s in streams))
    assert together == solo
    assert max(engine.stats.batch_sizes) >= 2


async def test_abort_frees_the_slot_within_a_step_others_unaffected(engine):
    ref = await collect(engine.submit(ask("Name a color.")))
    long = engine.submit(ask("Count from one to five hundred, one number per line.", n=400))
    short = engine.submit(ask("Name a color."))
    got = []
    async for d in long:
        got.append(d)
        if len(got) == 5:
            steps = engine.stats.steps
            long.abort()
    assert long.stats.finish_reason is FinishReason.ABORT
    assert engine.stats.steps - steps <= 2
    assert await collect(short) == ref
    await asyncio.sleep(0.1)
    assert engine.load().active == 0 and engine.runner.batch_size == 0 and engine.runner.cache is None


async def test_stop_strings_and_length(engine):
    s = engine.submit(ask("Count from 1 to 20 separated by commas.", n=60, stop=["5"]))
    text = await collect(s)
    assert "5" not in text and s.stats.finish_reason is FinishReason.STOP
    s = engine.submit(ask("Tell me a long story about a dragon.", n=5))
    await collect(s)
    assert s.stats.finish_reason is FinishReason.LENGTH and s.stats.output_tokens == 5


async def test_sampling_is_per_request_and_seeded(engine):
    a = await collect(engine.submit(ask("Write a word.", n=8, temperature=1.0, seed=7)))
    b = await collect(engine.submit(ask("Write a word.", n=8, temperature=1.0, seed=7)))
    assert a == b


async def test_streaming_unicode_is_exact(engine):
    s = engine.submit(ask("Repeat exactly: 你好世界 🙂🎉 café", n=30))
    deltas = [d async for d in s]
    assert not any("\ufffd" in d for d in deltas)


def test_context_budget_with_the_real_tokenizer(engine):
    h = ChatHistory("You are terse.")
    for i in range(40):
        h.add_turn(f"Tell me fact number {i} about the ocean and its creatures.", f"Fact {i}: the ocean is deep.")
    msgs = h.prompt("And one more?", engine.count_tokens, budget=200)
    assert engine.count_tokens(msgs) <= 200
    assert msgs[0]["content"] == "You are terse." and msgs[-1]["content"] == "And one more?"
    assert "fact number 39" in msgs[-3]["content"] and len(h.turns) < 40


BUDGET = LlmConfig().max_context_tokens - LlmConfig().max_new_tokens


def test_huge_user_text_keeps_its_end_within_budget(engine):
    user = "".join(chr(0x4E00 + (i * 37) % 20000) for i in range(7990)) + " 最后的问题"  # ~8000 CJK chars
    h = ChatHistory("You are terse.")
    h.add_turn("earlier", "reply")
    t0 = time.perf_counter()
    msgs = h.prompt(user, engine.count_tokens, BUDGET)
    assert time.perf_counter() - t0 < 5
    assert engine.count_tokens(msgs) <= BUDGET
    assert engine.count_tokens(msgs) > BUDGET - 20  # cut no more than needed
    assert msgs[0]["content"] == "You are terse." and len(msgs) == 2
    assert user.endswith(msgs[-1]["content"]) and msgs[-1]["content"].endswith("最后的问题")


def test_huge_system_prompt_keeps_its_beginning_within_budget(engine):
    system = "Rule one: be kind. " + "Always answer politely and briefly. " * 400
    h = ChatHistory(system)
    msgs = h.prompt("What time is it?", engine.count_tokens, BUDGET)
    assert engine.count_tokens(msgs) <= BUDGET
    assert system.startswith(msgs[0]["content"]) and msgs[0]["content"].startswith("Rule one")
    assert msgs[-1]["content"] == "What time is it?"
    words = "let us talk about the weather today " * 600
    msgs = h.prompt(words + "and what to wear", engine.count_tokens, BUDGET)  # both over budget
    assert engine.count_tokens(msgs) <= BUDGET
    assert engine.count_tokens([msgs[0]]) <= BUDGET // 2 + 10
    assert msgs[-1]["content"].endswith("and what to wear")
    assert msgs[-1]["content"].split()[0] in words.split()  # starts at a word boundary


async def test_long_prompt_prefills_in_chunks_while_another_request_streams(llm):
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=0, max_prefill_tokens=128))
    eng.start()
    try:
        short = eng.submit(ask("Count from one to fifty, one number per line.", n=60))
        times: list[float] = []
        async for _ in short:
            times.append(time.perf_counter())
            if len(times) == 3:
                break
        long_text = "The quick brown fox jumps over the lazy dog. " * 150  # ~1500 tokens: 12+ chunks
        long = eng.submit(ask(long_text + "How many foxes?", n=4))
        steps0 = eng.stats.steps
        long_first: list[float] = []

        async def read_long() -> None:
            async for _ in long:
                long_first.append(time.perf_counter())

        reader = asyncio.create_task(read_long())
        async for _ in short:
            times.append(time.perf_counter())
        await reader
        assert long.stats.finish_reason is FinishReason.LENGTH and long.stats.prompt_tokens > 1400
        during = [t for t in times[3:] if t < long_first[0]]
        assert len(during) >= 8  # the short request kept streaming while the long one prefilled
        assert eng.stats.steps - steps0 >= 12
        assert short.stats.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    finally:
        eng.stop()


async def test_short_prompt_is_not_queued_behind_long_prefills(llm):
    """Two long prompts are being prefilled in chunks when a short one arrives: with the
    prefill budget going to the shortest remaining prompt first, the short request's first
    token comes before either long request's (FCFS would make it wait for both)."""
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=0, max_prefill_tokens=128))
    eng.start()
    try:
        long_text = "The quick brown fox jumps over the lazy dog. " * 60  # ~600 tokens: 5+ chunks each
        longs = [eng.submit(ask(long_text + f"Question {i}: how many dogs?", n=2)) for i in range(2)]
        await until(lambda: eng.stats.steps >= 2)  # both long prompts are being prefilled
        short = eng.submit(ask("Say hi.", n=2))
        first: dict[str, float] = {}

        async def read(name: str, stream) -> None:
            async for _ in stream:
                first.setdefault(name, time.perf_counter())

        await asyncio.gather(read("short", short), *(read(f"long{i}", s) for i, s in enumerate(longs)))
        assert all(s.stats.prompt_tokens > 500 for s in longs)
        assert first["short"] < min(first["long0"], first["long1"])
    finally:
        eng.stop()


async def test_bad_sampling_settings_fail_only_their_own_request(engine):
    goods = [engine.submit(ask("Count from one to ten.", n=12)) for _ in range(2)]
    bads = [engine.submit(GenRequest(messages=[{"role": "user", "content": "Hi"}], **kw))
            for kw in ({"temperature": 1.0, "top_p": 0.0}, {"temperature": float("nan")},
                       {"max_new_tokens": 0})]
    for bad in bads:
        with pytest.raises(ValueError):
            async for _ in bad:
                pass
        assert bad.stats.finish_reason is FinishReason.ERROR
    for good in goods:
        assert "".join([d async for d in good]) and good.stats.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


async def test_tiny_top_p_samples_the_most_likely_token(engine):
    greedy = engine.submit(ask("Name a colour.", n=6))
    nucleus = engine.submit(GenRequest(messages=[{"role": "user", "content": "Name a colour."}], max_new_tokens=6,
                                       temperature=1.0, top_p=1e-6, seed=3))
    assert "".join([d async for d in greedy]) == "".join([d async for d in nucleus])


async def test_prompt_longer_than_the_model_context_is_refused(engine):
    context = engine.llm.model.config.max_position_embeddings
    big = engine.submit(GenRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=context))
    with pytest.raises(ValueError, match="context"):
        async for _ in big:
            pass


async def test_queue_bound_counts_requests_waiting_for_a_slot(llm):
    """One request runs (a long one, so it is still running at the end), three wait for
    its slot: the queue of 3 is full although the inbox is empty, and the rest are refused.
    Each step waits for the engine's state, never for a time."""
    eng = LlmEngine(llm, LlmConfig(queue_size=3), SchedulerConfig(max_batch_size=1, max_wait_ms=0))
    eng.start()
    count = "Count from one to five hundred, one number per line."
    try:
        streams = [eng.submit(ask(count, n=400))]
        await until(lambda: eng.load().active == 1)
        for i in range(3):
            streams.append(eng.submit(ask(f"Count to {i + 20}.", n=30)))
            await until(lambda i=i: len(eng.scheduler.waiting) == i + 1)  # moved from the inbox to waiting
        busy = 0
        for i in range(4):
            try:
                streams.append(eng.submit(ask(f"Count to {i + 30}.", n=30)))
            except Busy:
                busy += 1
        assert eng.load().active == 1 and eng.load().depth == 3 and busy == 4
        for s in streams:
            s.abort()
    finally:
        eng.stop()


def test_aborted_requests_leave_the_queue_depth_at_once(llm):
    """A request aborted while it waits (in the inbox, or for a batch slot) is nobody's
    wait: admission must not see it as queued work until the engine's next step drops it.
    The steps run by hand here (no engine thread), so nothing moves between the reads."""
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_batch_size=1, max_wait_ms=0))
    streams = [eng.submit(ask(f"Count to {i + 3}.", n=30)) for i in range(3)]
    assert eng.load().depth == 3
    streams[2].abort()
    assert eng.load().depth == 2  # still in the inbox
    eng.step()  # one joins the batch, one waits for its slot; the aborted one is dropped
    assert eng.load().active == 1 and len(eng.scheduler.waiting) == 1 and eng.load().depth == 1
    streams[1].abort()
    assert len(eng.scheduler.waiting) == 1 and eng.load().depth == 0  # there until the next step
    eng.step()
    assert not eng.scheduler.waiting and eng.load().depth == 0
    streams[0].abort()
    eng.step()
    assert eng.load().active == 0


async def test_engine_returns_free_memory_when_it_goes_idle(llm, monkeypatch):
    import pipeline.llm.host as host_module  # the engine's idle trimming lives there

    calls = []
    monkeypatch.setattr(host_module, "release_free_memory", lambda: calls.append(1))
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=0))
    eng.start()
    try:
        assert "".join([d async for d in eng.submit(ask("Say hi.", n=3))])
        for _ in range(100):
            if calls:
                break
            await asyncio.sleep(0.01)
        assert len(calls) == 1  # once per idle period, not on every wake-up
    finally:
        eng.stop()
    monkeypatch.undo()
    host_module.release_free_memory()  # the real helper is safe to call anywhere


async def test_an_oom_mid_reply_requeues_the_batch_and_every_reply_is_unchanged(engine, llm):
    """Recompute preemption (the out-of-memory ladder's steps 1-2): two OOMs in the 6th step
    drop the batch's KV, requeue every request with the tokens it already sent, and halve the
    batch; each greedy reply is exactly what it is without the OOMs (fp32), none lost."""
    from pipeline.fault_rules import parse_rules
    from pipeline.serving.faults import FaultInjector
    from pipeline.serving.ladder import OomLadder

    prompts = ["What is the capital of France?", "Name a color.", "Say hello in French.", "What is 2 plus 2?"]
    solo = [await collect(engine.submit(ask(p))) for p in prompts]
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=200, max_batch_size=4))
    eng.faults = FaultInjector(parse_rules(["llm:oom@6x2"]))
    eng.faults.arm()
    eng.ladder = OomLadder("llm", max_step=3, calm_s=600)
    eng.start()
    try:
        streams = [eng.submit(ask(p)) for p in prompts]
        assert await asyncio.gather(*(collect(s) for s in streams)) == solo
        assert all(s.stats.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for s in streams)
        assert eng.ladder.step == 2 and eng.preempted >= len(prompts)
        assert eng.scheduler.cfg.max_batch_size == 2 and max(eng.stats.batch_sizes[-5:]) <= 2
    finally:
        eng.stop()


async def test_a_conversation_reuses_its_earlier_turns_kv_and_every_reply_is_unchanged(engine, llm):
    """Prefix caching through the engine (fp32 SmolLM2): each turn of a conversation finds the
    system prompt, the earlier turns and the last reply in the block cache and prefills only the
    new tokens; the greedy replies equal an engine's without the cache; the session's blocks go
    when it ends."""
    plain = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=5))
    plain.runner.blocks = None
    plain.start()
    cached = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=5))
    cached.start()
    try:
        history = ChatHistory(LlmConfig().system_prompt)
        budget = LlmConfig().max_context_tokens - 24
        questions = ["What is the capital of France?", "And of Italy?", "Which one is bigger?",
                     "Name a river in each.", "Thanks. Say goodbye."]
        for i, q in enumerate(questions):
            msgs = history.prompt(q, cached.count_tokens, budget)
            before = cached.prefix.stats
            reply = await collect(cached.submit(GenRequest(messages=msgs, max_new_tokens=24, session="s1")))
            assert reply == await collect(plain.submit(GenRequest(messages=msgs, max_new_tokens=24))), f"turn {i}"
            queried, hit = (a - b for a, b in zip(cached.prefix.stats[:2], before[:2]))
            if i:  # everything but the new question and the template around it was cached
                assert hit >= 0.6 * queried, f"turn {i}: {hit} of {queried} prompt tokens cached"
            history.add_turn(q, reply)
        held = cached.prefix.stats[3]
        cached.end_session("s1")
        await until(lambda: cached.prefix.stats[3] < held)
    finally:
        cached.stop()
        plain.stop()


async def test_the_prefix_cache_fills_only_what_the_kv_budget_leaves(llm):
    """With a KV budget of about one full request, many different conversations fill the cache:
    it evicts least recently used blocks and never holds more than the budget leaves."""
    eng = LlmEngine(llm, LlmConfig(memory_budget_mb=1.0), SchedulerConfig(max_wait_ms=5))
    budget = eng.load().kv_budget
    assert budget <= LlmConfig().max_context_tokens + LlmConfig().max_new_tokens  # raised to one full request
    eng.start()
    try:
        seen = []
        for i in range(12):
            topic = f"Tell me one fact about the number {i * 7919}, the ocean and the color {i}. " * 6
            await collect(eng.submit(ask(topic, 8)))
            seen.append(eng.prefix.stats[3])
            assert seen[-1] <= budget
        queried, hit, evicted, tokens = eng.prefix.stats
        assert evicted > 0 and 0 < tokens <= budget and max(seen) > budget // 2  # it filled up, then evicted
    finally:
        eng.stop()
