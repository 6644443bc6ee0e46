"""A request's stream (pipeline.llm.stream) and the engine's step glue, with a tiny random
Llama in fp32 and a one-character-per-token tokenizer: no real model, fast.

Nothing here waits on wall-clock time: tests wait for a state (with a generous deadline)."""

from __future__ import annotations

import asyncio
import json
import threading
from types import SimpleNamespace

import pytest
import torch

from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.llm.engine import LlmEngine
from pipeline.llm.stream import TokenStream
from pipeline.llm.types import FinishReason, GenRequest
from tests.fakes import CharTokenizer


@pytest.fixture(scope="module")
def tiny_llm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=1, pad_token_id=0, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval().float()
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), device=torch.device("cpu"), dtype=torch.float32,
                           name="tiny")


@pytest.fixture
def engine(tiny_llm):
    eng = LlmEngine(tiny_llm, LlmConfig(), SchedulerConfig(max_wait_ms=0))
    eng.start()
    yield eng
    eng.stop()


def ask(text: str, n: int) -> GenRequest:
    return GenRequest(messages=[{"role": "user", "content": text}], max_new_tokens=n)


def reference(llm, req: GenRequest) -> tuple[str, int]:
    """The reply decoded at once from transformers' greedy ``generate``: (text, tokens)."""
    prompt = llm.tokenizer.apply_chat_template(req.messages)
    out = llm.model.generate(torch.tensor([prompt]), max_new_tokens=req.max_new_tokens, do_sample=False,
                             eos_token_id=[1], pad_token_id=0)[0, len(prompt):].tolist()
    return llm.tokenizer.decode(out, skip_special_tokens=True), len(out)


async def until(cond, timeout_s: float = 120.0) -> None:
    """Wait until ``cond()`` holds; fail after a deadline far beyond any machine's speed."""
    for _ in range(int(timeout_s / 0.005)):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


# ---- the stream alone -------------------------------------------------------------------


async def test_unread_text_is_merged_and_the_end_comes_after_it():
    s = TokenStream()
    for c in "hello":
        s.put(c)
    s.end()
    assert [d async for d in s] == ["hello"]
    assert [d async for d in s] == []  # ended for good


async def test_an_error_is_raised_after_all_text_then_the_stream_ends():
    s = TokenStream()
    s.put("partial ")
    s.put("reply")
    s.end(RuntimeError("step failed"))
    s.put("ignored")  # nothing after the end
    assert await anext(s) == "partial reply"
    with pytest.raises(RuntimeError, match="step failed"):
        await anext(s)
    with pytest.raises(StopAsyncIteration):
        await anext(s)


async def test_the_loop_is_woken_only_when_the_reader_waits(monkeypatch):
    loop = asyncio.get_running_loop()
    wakes = []
    real = loop.call_soon_threadsafe
    monkeypatch.setattr(loop, "call_soon_threadsafe", lambda *a: wakes.append(1) or real(*a))
    s = TokenStream()
    n, first_read, more = 2000, threading.Event(), threading.Event()

    def produce() -> None:
        s.put("x")
        first_read.wait()
        for _ in range(n - 1):  # the reader is busy elsewhere: these merge
            s.put("x")
        more.set()
        s.end()

    producer = threading.Thread(target=produce)
    producer.start()
    assert await anext(s) == "x"
    first_read.set()
    await until(more.is_set)
    rest = [d async for d in s]
    producer.join()
    assert "".join(rest) == "x" * (n - 1) and len(rest) == 1
    assert len(wakes) <= 1  # at most for the first delta (if the reader was waiting): never once per token


async def test_a_cancelled_reader_leaves_the_stream_usable():
    s = TokenStream()
    reader = asyncio.create_task(anext(s))
    await asyncio.sleep(0)
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    s.put("ok")
    s.end()
    assert [d async for d in s] == ["ok"]


def test_abort_wakes_the_engine():
    wake = threading.Event()
    s = TokenStream(wake)
    s.abort()
    s.abort()  # idempotent
    assert s.aborted.is_set() and wake.is_set()


def test_finish_reasons_are_the_wire_strings():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert json.dumps({"finish_reason": FinishReason.LENGTH}) == '{"finish_reason": "length"}'
    assert FinishReason.STOP == "stop"


# ---- the engine with a tiny model -------------------------------------------------------


async def test_a_reader_that_lags_gets_the_whole_text_in_a_few_merged_deltas(engine, tiny_llm):
    req = ask("Tell me a story.", 200)
    want, tokens = reference(tiny_llm, req)
    assert tokens == 200  # no end-of-sequence: many tokens to merge
    stream = engine.submit(req)
    deltas = [await anext(stream)]  # the first token's text, then nobody reads for a while
    await until(lambda: stream.ended)  # the whole reply was generated meanwhile
    deltas += [d async for d in stream]
    assert len(deltas) < tokens and len(deltas) <= 3
    assert "".join(deltas) == want
    assert stream.stats.finish_reason is FinishReason.LENGTH and stream.stats.output_tokens == tokens


async def test_a_reader_that_keeps_up_gets_the_same_text(engine, tiny_llm):
    req = ask("Tell me a story.", 60)
    stream = engine.submit(req)
    assert "".join([d async for d in stream]) == reference(tiny_llm, req)[0]
    assert stream.stats.ttft_ms > 0 and stream.stats.prompt_tokens == len(tiny_llm.tokenizer.apply_chat_template(
        req.messages))


async def test_a_failed_step_ends_its_streams_with_the_error_after_their_text(engine, tiny_llm):
    execute, calls = engine.runner.execute, []

    def flaky(plan):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("boom")
        return execute(plan)

    engine.runner.execute = flaky
    stream = engine.submit(ask("Tell me a story.", 100))
    got = []
    with pytest.raises(RuntimeError, match="boom"):
        async for d in stream:
            got.append(d)
    assert stream.stats.finish_reason is FinishReason.ERROR
    assert reference(tiny_llm, ask("Tell me a story.", 100))[0].startswith("".join(got)) and got
    engine.runner.execute = execute  # the engine carries on
    req = ask("Again.", 10)
    assert "".join([d async for d in engine.submit(req)]) == reference(tiny_llm, req)[0]


async def test_stop_ends_queued_and_running_streams_with_abort(tiny_llm):
    eng = LlmEngine(tiny_llm, LlmConfig(), SchedulerConfig(max_batch_size=1, max_wait_ms=0))
    running = eng.submit(ask("Tell me a story.", 400))
    eng.start()
    await until(lambda: eng.load().active == 1)
    queued = eng.submit(ask("Wait.", 5))
    eng.stop()
    for s in (running, queued):
        [_ async for _ in s]
        assert s.stats.finish_reason is FinishReason.ABORT


async def test_step_sleeps_forever_only_when_there_is_no_work(tiny_llm):
    eng = LlmEngine(tiny_llm, LlmConfig(), SchedulerConfig(max_wait_ms=0))  # no thread: step by hand
    assert eng.step() == float("inf")
    stream = eng.submit(ask("Hi.", 3))
    while eng.step() == 0:
        pass
    assert "".join([d async for d in stream]) == reference(tiny_llm, ask("Hi.", 3))[0]
    assert stream.stats.finish_reason is FinishReason.LENGTH
    # prefill, 2 decodes, then a step that frees the row
    assert eng.stats.steps == 4 and eng.stats.batch_sizes == [1, 1, 1]
    assert eng.runner.batch_size == 0 and eng.load().active == 0
