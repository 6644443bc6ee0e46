"""The GPU twin of the out-of-memory ladder: a real CUDA out-of-memory error, not an injected
one (``torch.cuda.set_per_process_memory_fraction`` leaves room for about half the batch's
KV cache), climbs the LLM engine's ladder; every reply completes, none is lost. Skipped
without CUDA; the CPU twins (injected OOMs) are tests/test_degrade_server.py and
tests/test_llm_engine.py's recompute-preemption test."""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")

from pipeline.config import LlmConfig, SchedulerConfig  # noqa: E402
from pipeline.llm.engine import LlmEngine  # noqa: E402
from pipeline.llm.loader import load_llm  # noqa: E402
from pipeline.llm.types import FinishReason, GenRequest  # noqa: E402
from pipeline.serving.ladder import OomLadder  # noqa: E402

PROMPT_CHARS = 9000  # about 2,000 tokens: each request's KV is tens of MB


def ask(text: str) -> GenRequest:
    return GenRequest(messages=[{"role": "user", "content": text}], max_new_tokens=16)


async def drain(stream) -> str:
    return "".join([d async for d in stream])


@pytest.mark.gpu
@pytest.mark.slow
async def test_a_real_cuda_oom_climbs_the_ladder_and_every_reply_completes():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    llm = load_llm("smollm2", device="cuda")
    cfg = LlmConfig(max_new_tokens=16, max_context_tokens=4096)
    eng = LlmEngine(llm, cfg, SchedulerConfig(max_batch_size=8, max_wait_ms=500, max_kv_tokens=65536))
    eng.ladder = OomLadder("llm", max_step=2, calm_s=600)
    texts = [f"{i}: " + "the sea is wide and deep. " * (PROMPT_CHARS // 26) for i in range(8)]
    eng.start()
    try:
        # one request alone: its peak is what a batch slot costs
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        await drain(eng.submit(ask(texts[0])))
        one = torch.cuda.max_memory_allocated() - base
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.empty_cache()
        # room for the weights and about 4 such requests: 8 at once must run out
        torch.cuda.set_per_process_memory_fraction(min(1.0, (base + 4.5 * one) / total))
        streams = [eng.submit(ask(t)) for t in texts]
        replies = await asyncio.wait_for(asyncio.gather(*(drain(s) for s in streams)), 600)
        print(f"one request's peak {one / 2**20:.0f} MiB; ladder step {eng.ladder.step}; "
              f"{eng.ladder.ooms} OOMs; {eng.preempted} requests requeued; "
              f"batch now {eng.scheduler.cfg.max_batch_size}")
        assert all(replies) and all(s.stats.finish_reason is not FinishReason.ERROR for s in streams)
        assert eng.ladder.ooms >= 1 and eng.ladder.step >= 1 and eng.preempted >= 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        eng.stop()
