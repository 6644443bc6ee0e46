"""Admission by memory estimate (pipeline.llm.memory, the engine's KV token budget): the
formula against the real KV tensors of a tiny random Llama, a small ``--memory-budget``
serializing requests, the metrics and the option. The ``gpu`` twin compares the estimate
with ``torch.cuda.max_memory_allocated``."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cli.flags import config_from_args
from cli.main import build_parser
from pipeline import metrics
from pipeline.config import AdmissionConfig, LlmConfig, SchedulerConfig, VoxpipeConfig
from pipeline.engines import Engines
from pipeline.llm import memory
from pipeline.llm.engine import LlmEngine
from pipeline.llm.types import FinishReason, GenRequest
from pipeline.serving.admission import Admission
from tests.fakes import CharTokenizer, FakeAsr, FakeTts, FakeVad

GIB = 1 << 30



def tiny(dtype=torch.float32, device="cpu", **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    kw: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                              eos_token_id=1, pad_token_id=0, bos_token_id=None)
    kw.update(over)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval().to(device=device, dtype=dtype)
    return SimpleNamespace(model=model, tokenizer=CharTokenizer(), device=torch.device(device), dtype=dtype,
                           name="tiny")


@pytest.fixture(scope="module")
def tiny_llm():
    return tiny()


def weights_of(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def ask(text: str, n: int) -> GenRequest:
    return GenRequest(messages=[{"role": "user", "content": text}], max_new_tokens=n, stop=[])


async def drain(stream) -> str:
    return "".join([d async for d in stream])


def run_by_hand(eng: LlmEngine, on_step=None) -> None:
    """Step the engine (no thread) until it has no work left."""
    while eng.step() == 0:
        if on_step is not None:
            on_step()


# ---- the formula -----------------------------------------------------------------------


def test_kv_bytes_per_token_formula_and_its_inputs():
    qwen = SimpleNamespace(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    assert memory.kv_bytes_per_token(qwen, "bfloat16") == 2 * 24 * 2 * 64 * 2 == 12288
    assert memory.kv_bytes_per_token(qwen, torch.float32) == 24576  # str(torch.float32) = "torch.float32"
    assert memory.kv_bytes_per_token(qwen, 1) == 6144
    explicit = SimpleNamespace(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=None, hidden_size=512,
                               head_dim=128)  # head_dim given: not hidden // heads; no GQA: kv = heads
    assert memory.kv_bytes_per_token(explicit, 2) == 2 * 2 * 8 * 128 * 2
    assert memory.request_bytes(qwen, 2, 100, 28) == 128 * 12288
    for bad in (lambda: memory.dtype_bytes("complex32"), lambda: memory.dtype_bytes(0),
                lambda: memory.request_bytes(qwen, 2, -1, 1), lambda: memory.activation_bytes(qwen, 2, -1)):
        with pytest.raises(ValueError):
            bad()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_formula_equals_a_transformers_cache(dtype):
    llm = tiny(dtype)
    n = 37
    with torch.inference_mode():
        out = llm.model(input_ids=torch.arange(2, 2 + n)[None], use_cache=True)
    layers = out.past_key_values.layers
    real = sum(x.numel() * x.element_size() for layer in layers for x in (layer.keys, layer.values))
    assert real == memory.kv_bytes_per_token(llm.model.config, dtype) * n


def test_activation_estimate_counts_what_it_says():
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=256)
    per_token = (2 * 64 + (4 + 2 * 2) * 16 + 3 * 128) * 2 + 64 * 4
    assert memory.activation_bytes(cfg, 2, 10) == 10 * per_token + 4 * 10 * 10 * 4 + 10 * 256 * 6
    assert memory.activation_bytes(cfg, 2, 10, attended=100, logits_rows=1) == (
        10 * per_token + 4 * 10 * 100 * 4 + 256 * 6)
    assert memory.activation_bytes(cfg, 2, 0) == 0


def test_the_plan_turns_tokens_into_bytes_and_leaves_the_cache_its_room():
    plan = memory.MemoryPlan(budget=1 << 20, source="--memory-budget", weights=1000, activations=2000,
                             per_token=512, fit=100, configured=80, floor=72, kv_tokens=80)
    assert plan.kv_bytes(29) == plan.request_bytes(21, 8) == 29 * 512
    assert plan.request_bytes(0, 0) == plan.kv_bytes(0) == 0
    assert (plan.kv_free(30), plan.kv_free(80), plan.kv_free(200)) == (50, 0, 0)
    with pytest.raises(ValueError):
        plan.request_bytes(-1, 8)


async def test_formula_against_the_batch_kv_buffers(tiny_llm):
    eng = LlmEngine(tiny_llm, LlmConfig(), SchedulerConfig(max_wait_ms=0))  # no thread: step by hand
    cfg = tiny_llm.model.config
    assert eng.memory.per_token == 2 * 2 * 2 * 16 * 4 == 512  # fp32, 2 layers, 2 kv heads, head_dim 16
    streams = [eng.submit(ask(t, n)) for t, n in (("Hi.", 40), ("Tell me a longer story, please.", 30),
                                                  ("A medium question?", 50))]
    seen = []

    def check() -> None:
        batch = eng.runner.batch
        rids = [r.rid for r in eng.runner.slots if r is not None]
        if batch is None or len(rids) < 3 or not all(rid in eng.scheduler.requests for rid in rids):
            return  # not all three decoding, or one finished (its row leaves at the next step)
        slots, cols = batch.capacity
        # every layer's K and V buffer: slots × kv_heads × columns × head_dim elements
        per_layer = eng.memory.per_token // (2 * cfg.num_hidden_layers)
        assert all(x.numel() * x.element_size() == per_layer * slots * cols for x in (*batch.kb, *batch.vb))
        assert eng.runner.kv_buffer_bytes == batch.nbytes == eng.memory.per_token * slots * cols
        # the tokens really held: each live row's prompt + tokens sampled so far, but its
        # last sampled token (not yet run through the model) — the unmasked columns
        live = [eng.scheduler.requests[rid] for rid in rids]
        held = sum(len(r.prompt_ids) + len(r.output_ids) - 1 for r in live)
        assert int(batch.attn.sum()) == held
        # the estimate (prompt + max new tokens per request) bounds what is held; the
        # buffers' over-allocation is exactly the padding, the free slots and the slack
        reserved = eng.memory.kv_bytes(eng.load().kv_reserved)
        assert held * eng.memory.per_token <= reserved
        assert reserved == sum(eng.memory.request_bytes(len(r.prompt_ids), r.max_new_tokens) for r in live)
        assert batch.nbytes - held * eng.memory.per_token == eng.memory.per_token * (slots * cols - held)
        seen.append((held, slots, cols))

    run_by_hand(eng, check)
    assert seen, "the three requests never decoded together"
    assert all(s == 3 for _, s, _ in seen)  # three rows, three slots: no slot over-allocation here
    texts = [await drain(s) for s in streams]
    assert all(s.stats.finish_reason in (FinishReason.LENGTH, FinishReason.STOP) for s in streams) and texts


# ---- the budget ------------------------------------------------------------------------


def test_budget_sources():
    assert memory.budget_bytes(weights=GIB, memory_budget_mb=512) == 512 << 20  # the option wins, weights in it
    assert memory.budget_bytes(weights=GIB, device_free=10 * GIB) == GIB + 9 * GIB
    # CPU default: a 24 GiB machine with 22 GiB available keeps 11 GiB for KV + activations:
    # ~950,000 tokens of Qwen2.5-0.5B in bf16, far over the default max_kv_tokens (16384)
    qwen = SimpleNamespace(num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, hidden_size=896)
    b = memory.budget_bytes(weights=GIB, available_ram=22 * GIB)
    assert b == 12 * GIB
    assert memory.kv_token_budget(b, GIB, 0, memory.kv_bytes_per_token(qwen, 2)) > 900_000
    with pytest.raises(ValueError):
        memory.budget_bytes(weights=0, memory_budget_mb=-1)
    with pytest.raises(ValueError):
        memory.budget_bytes(weights=0, cpu_fraction=0)
    assert memory.kv_token_budget(10, 20, 0, 4) == 0


def test_the_default_budget_keeps_the_configured_kv_tokens(tiny_llm):
    eng = LlmEngine(tiny_llm, LlmConfig(), SchedulerConfig())
    m = eng.memory
    assert m.source.startswith("weights + available RAM")
    assert m.weights == weights_of(tiny_llm.model)
    assert m.fit > 16384 and eng.load().kv_budget == 16384  # RAM is not short here: the configured budget stays
    assert m.budget > m.weights + m.activations


def budget_for(tiny_llm, tokens: float, **llm_kw) -> float:
    """``--memory-budget`` (MiB) that leaves room for ``tokens`` KV tokens on ``tiny_llm``."""
    probe = LlmEngine(tiny_llm, LlmConfig(**llm_kw), SCHED)
    m = probe.memory
    return (m.weights + m.activations + tokens * m.per_token) / memory.MIB


SCHED = SchedulerConfig(max_wait_ms=0, max_prefill_tokens=64, max_prefill_attention=64 * 64)
SMALL: dict[str, Any] = dict(max_context_tokens=64, max_new_tokens=8)  # one full request: 72 tokens


async def test_a_small_budget_serializes_requests_and_admission_says_memory(tiny_llm):
    mb = budget_for(tiny_llm, 80.5, **SMALL)
    cfg = VoxpipeConfig(llm=LlmConfig(memory_budget_mb=mb, **SMALL), llm_batch=SCHED).validate()
    eng = LlmEngine(tiny_llm, cfg.llm, cfg.llm_batch)
    assert eng.memory.source == "--memory-budget" and eng.memory.fit == 80 and eng.load().kv_budget == 80
    reqs = [ask("Hi.", 30), ask("Yo.", 30)]  # 21 prompt tokens + 30 each: 51 fits, 102 does not
    streams = [eng.submit(r) for r in reqs]
    engines = Engines(vad=FakeVad(), asr=FakeAsr(), llm=eng, tts=FakeTts())
    admission = Admission(AdmissionConfig())
    active, refusals = [], []

    def watch() -> None:
        active.append(eng.load().active)
        if eng.load().active:
            refusal = admission.decide(engines.load(cfg), spoken=False, end_silence_ms=0,
                                       kv_tokens=cfg.llm.max_context_tokens, now=0.0, count=False)
            refusals.append(refusal and refusal.reason)

    run_by_hand(eng, watch)
    assert max(active) == 1 and len(eng.stats.batch_sizes) >= 60  # one at a time: 2 × (prefill + 29 decodes)
    assert set(refusals) == {"memory"}  # a new turn while one runs would overflow the KV budget
    for s in streams:
        await drain(s)
        assert s.stats.output_tokens == 30 and s.stats.finish_reason is FinishReason.LENGTH
    # the same two requests together under the default budget
    both = LlmEngine(tiny_llm, LlmConfig(**SMALL), SCHED)
    streams = [both.submit(r) for r in reqs]
    sizes = []
    run_by_hand(both, lambda: sizes.append(both.load().active))
    assert max(sizes) == 2
    await asyncio.gather(*(drain(s) for s in streams))


async def test_a_budget_under_one_request_still_runs_a_lone_request(tiny_llm, caplog):
    caplog.set_level("INFO", logger="pipeline.llm.memory")
    eng = LlmEngine(tiny_llm, LlmConfig(memory_budget_mb=0.001, **SMALL), SCHED)
    assert eng.memory.fit == 0 and eng.load().kv_budget == 72  # raised to one full request
    assert "raised to one full request of 72" in caplog.text
    stream = eng.submit(ask("Hi.", 8))
    run_by_hand(eng)
    assert len(await drain(stream)) >= 0 and stream.stats.finish_reason is FinishReason.LENGTH


# ---- metrics, option, validation -------------------------------------------------------


def test_metrics_expose_the_budget_and_the_estimate(tiny_llm):
    eng = LlmEngine(tiny_llm, LlmConfig(**SMALL), SCHED)
    eng.submit(ask("Hi.", 8))
    eng.step()  # the request joins the batch: 21 + 8 tokens reserved
    engines = Engines(vad=FakeVad(), asr=FakeAsr(), llm=eng, tts=FakeTts())
    text = metrics.render(engines).decode()

    def value(name: str) -> float:
        line = next(x for x in text.splitlines() if x.startswith(name + " "))
        return float(line.split()[1])

    assert value("voxpipe_llm_kv_bytes_per_token") == 512
    assert value("voxpipe_llm_kv_reserved_bytes") == 29 * 512 == eng.memory.kv_bytes(eng.load().kv_reserved)
    assert value("voxpipe_llm_memory_budget_bytes") == eng.memory.budget
    eng.stop()


def test_memory_budget_option_and_validation():
    args = build_parser().parse_args(["serve", "--memory-budget", "512"])
    assert config_from_args(args).llm.memory_budget_mb == 512.0
    assert config_from_args(build_parser().parse_args(["serve"])).llm.memory_budget_mb == 0.0
    for bad in (-1.0, math.nan):
        with pytest.raises(ValueError, match="memory_budget_mb"):
            VoxpipeConfig(llm=LlmConfig(memory_budget_mb=bad)).validate()


# ---- CUDA: the estimate against the allocator's peak -------------------------------------


@pytest.mark.gpu
async def test_estimate_against_cuda_max_memory_allocated():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    llm = tiny(torch.bfloat16, "cuda", hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=4)
    eng = LlmEngine(llm, LlmConfig(), SchedulerConfig(max_wait_ms=0))
    assert eng.memory.source.startswith("weights + CUDA free")
    assert eng.memory.weights == weights_of(llm.model)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    prompt_tokens = len(CharTokenizer().apply_chat_template([{"role": "user", "content": "x" * 400}]))
    streams = [eng.submit(ask("x" * 400, 16)), eng.submit(ask("Hi.", 16))]
    kv_buffers = []
    run_by_hand(eng, lambda: kv_buffers.append(eng.runner.kv_buffer_bytes))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    for s in streams:
        await drain(s)
    # the long prompt's KV alone was resident at once: the per-token formula does not overestimate
    assert peak >= eng.memory.per_token * prompt_tokens
    # one step's activations (estimated for the biggest step) + the KV buffers and the prefill's
    # transient KV copies (compaction, the slot write: at most 4 copies) bound the peak
    assert peak <= eng.memory.activations + 4 * max(kv_buffers)


def test_weights_count_packed_and_int8_linears():
    from pipeline.llm.runner.cpu_linear import pack_linears, packing_supported
    from pipeline.llm.runner.runner import ModelRunner

    model = tiny(torch.bfloat16).model
    runner = ModelRunner(model, torch.device("cpu"), 0)
    plain = runner.weight_bytes
    assert plain == weights_of(model) and runner.kv_dtype_bytes == 2
    if packing_supported():
        assert pack_linears(model) > 0 and runner.weight_bytes == plain  # the packed weights still count
    fp32 = tiny().model
    int8 = torch.ao.quantization.quantize_dynamic(fp32, {torch.nn.Linear}, dtype=torch.qint8)
    runner = ModelRunner(int8, torch.device("cpu"), 0)
    linears = sum(m.in_features * m.out_features for m in tiny().model.modules() if isinstance(m, torch.nn.Linear))
    assert runner.kv_dtype_bytes == 4  # int8 weights, fp32 activations and KV
    assert linears <= runner.weight_bytes < weights_of(tiny().model)
