"""Weight-only quantized linears (pipeline/llm/runner/quant_linear.py): the kernels against a
dequantized-weight reference, the bf16 copy for wide steps, per-layer fallback, and
continuous batching on a tiny int4 model."""

from __future__ import annotations

import pytest
import torch

from pipeline.llm.runner import native, quant_linear
from pipeline.llm.runner.quant_linear import (
    MAX_ROWS,
    NATIVE_MAX_ROWS,
    QuantLinear,
    dequantize_int4,
    native_max_rows,
    quantize_int4,
    quantize_int8,
    quantize_linears,
)
from pipeline.llm.runner.runner import ModelRunner
from tests.test_batching import run


def _linear(n: int, k: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(3)
    return lin.to(torch.bfloat16)


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    # bf16 output: one rounding of each result (2^-8 relative) plus the kernel's accumulation order
    err = (y.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item(), err


@pytest.mark.parametrize("rows", [1, 3, 8, 200])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_matches_the_dequantized_weight(rows, group):
    lin = _linear(96, 256, bias=True)
    q = QuantLinear(lin, "int4", group=group, native=False)  # PyTorch's kernel for every shape
    assert q.group == group and q.dense is None
    ref_w = dequantize_int4(*quantize_int4(lin.weight, group), group)
    # quantization itself is close to the weight: half a step of (max − min)/15 ≤ 2·max|w|/15
    # per group, and a little for the bf16 scale and zero
    w = lin.weight.detach().float()
    assert (ref_w - w).abs().max() <= w.abs().max() / 15 * 1.1
    x = torch.randn(2, rows, 256).to(torch.bfloat16)  # (batch, tokens, features) as the model sends it
    y = q(x)
    assert y.shape == (2, rows, 96) and y.dtype == torch.bfloat16
    _close(y, x.float() @ ref_w.T + lin.bias.detach().float())


@pytest.mark.parametrize("rows", [1, 8, 200])
def test_int8_matches_the_dequantized_weight(rows):
    lin = _linear(48, 80)
    q = QuantLinear(lin, "int8")
    qw, s = quantize_int8(lin.weight)
    x = torch.randn(rows, 80).to(torch.bfloat16)
    _close(q(x), x.float() @ (qw.float() * s.float()[:, None]).T)


def test_wide_steps_take_the_bf16_copy_and_narrow_ones_the_kernel():
    lin = _linear(64, 128)
    hybrid, quant = QuantLinear(lin, "int4", max_rows=4), QuantLinear(lin, "int4")
    wide, narrow = torch.randn(1, 9, 128).to(torch.bfloat16), torch.randn(1, 4, 128).to(torch.bfloat16)
    assert torch.equal(hybrid(narrow), quant(narrow))  # ≤ 4 rows: the int4 kernel
    assert hybrid.dense is not None
    assert torch.equal(hybrid(wide), hybrid.dense(wide))  # > 4 rows: bf16
    _close(hybrid(wide), wide.float() @ lin.weight.detach().float().T)
    assert not torch.equal(hybrid(wide), quant(wide))


def test_shapes_the_kernels_reject_stay_bf16_and_are_counted():
    model = torch.nn.Sequential()
    model.add_module("ok", _linear(64, 96))  # K 96: group 32
    model.add_module("odd_n", _linear(100, 64))  # N not a multiple of 16
    model.add_module("odd_k", _linear(64, 40))  # no group divides K
    report = quantize_linears(model, "int4", max_rows=None)
    assert report.quantized == ["ok"] and set(report.kept) == {"odd_n", "odd_k"}
    assert isinstance(model.ok, QuantLinear) and model.ok.group == 32
    assert type(model.odd_n) is torch.nn.Linear and "100x64" in report.kept["odd_n"]
    assert "2 kept bf16" in str(report)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(model, "int3")
    # a preferred group the layer's K does not take falls back to one that divides it
    assert QuantLinear(_linear(16, 96), "int4", group=64, native=False).group == 32


def _tiny_bf16():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval().to(torch.bfloat16)


def _specs() -> list[tuple[int, list[int], int]]:
    g = torch.Generator().manual_seed(5)
    specs = []
    for i in range(6):
        prompt = torch.randint(1, 256, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
        specs.append((i * 2, prompt, int(torch.randint(5, 25, (1,), generator=g))))
    return specs


def test_int4_continuous_batching_is_token_identical_to_alone():
    model = _tiny_bf16()
    report = quantize_linears(model, "int4", max_rows=None, native=False)  # PyTorch's kernel on every layer
    assert len(report.quantized) == 2 * 7 + 1 and not report.kept  # the untied LM head too
    specs = _specs()
    together = run(model, specs, max_batch=4, prefill_budget=32)  # chunked and mixed prefill steps
    for rid, spec in enumerate(specs):
        assert together[rid] == run(model, [(0, spec[1], spec[2])])[0], f"request {rid} differs"


NEAR_TIE = 0.05
"""Top-2 logit gap (the tiny random model's logits span about ±1) below which a greedy pick
may go either way with int8 activations: a prompt prefilled inside a mixed step runs its
attention as a different SDPA call than alone (a masked chunk against a causal prompt), an
ulp apart in bf16, and quantizing activations to int8 per 32 turns an ulp into up to ~1e-2
of a logit (measured 8e-3 on the request below)."""


@pytest.mark.native
def test_native_int4_batching_changes_a_reply_only_at_a_near_tie(monkeypatch):
    model = _tiny_bf16()
    assert len(quantize_linears(model, "int4", max_rows=None).quantized) == 15
    assert all(m.native for m in model.modules() if isinstance(m, QuantLinear))
    logits: dict[int, list[torch.Tensor]] = {}
    sample = ModelRunner._sample

    def recording(self, lg, rows):
        for r, row in zip(rows, lg):
            logits.setdefault(r.rid, []).append(row.float().clone())
        return sample(self, lg, rows)

    monkeypatch.setattr(ModelRunner, "_sample", recording)
    specs = _specs()
    together = run(model, specs, max_batch=4, prefill_budget=32)
    identical = 0
    for rid, spec in enumerate(specs):
        logits.pop(0, None)
        alone = run(model, [(0, spec[1], spec[2])])[0]
        k = next((i for i, (a, b) in enumerate(zip(alone, together[rid])) if a != b), None)
        if k is None:
            assert len(alone) == len(together[rid])
            identical += 1
            continue
        top = torch.topk(logits[0][k], 2).values  # the alone run's logits where the replies fork
        assert float(top[0] - top[1]) < NEAR_TIE, f"request {rid} forks at token {k} without a near-tie"
    assert identical >= 4, identical


def test_the_lm_head_is_quantized_only_when_untied():
    tied = _tiny_bf16()
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert "lm_head" in quantize_linears(tied, "int4").kept
    assert "lm_head" in quantize_linears(_tiny_bf16(), "int4").quantized


def test_weights_count_the_int4_buffers_and_the_bf16_copy():
    plain = ModelRunner(_tiny_bf16(), torch.device("cpu"), 0).weight_bytes
    small, hybrid = _tiny_bf16(), _tiny_bf16()
    quantize_linears(small, "int4", max_rows=None, lm_head=False)
    quantize_linears(hybrid, "int4", max_rows=8, lm_head=False)
    linears = sum(m.in_features * m.out_features for m in _tiny_bf16().modules()
                  if isinstance(m, torch.nn.Linear) and m.out_features != 256)  # all but the LM head
    small_b = ModelRunner(small, torch.device("cpu"), 0).weight_bytes
    # int4: half a byte per weight + 4 bytes (bf16 scale, zero) per group of 32 replace 2 bytes
    assert small_b == plain - 2 * linears + linears // 2 + 4 * linears // 32
    assert ModelRunner(hybrid, torch.device("cpu"), 0).weight_bytes >= small_b + 2 * linears


def test_the_kernel_keeps_no_bf16_copy_by_default_except_on_amx(monkeypatch):
    flags = "flags\t\t: fpu avx512f avx512bw avx512vl avx512_vnni avx512_bf16 f16c fma"
    assert native_max_rows(flags + "\n") is None
    assert native_max_rows(flags + " amx_bf16 amx_tile amx_int8\n") == NATIVE_MAX_ROWS
    assert native_max_rows("processor: 0\n") is None
    # quantize_linears' default follows it where voxpipe's kernel runs
    monkeypatch.setattr(quant_linear, "native_max_rows", lambda: 5)
    if native.available():
        model = torch.nn.Sequential(_linear(64, 128))
        quantize_linears(model, "int4")
        assert model[0].native and model[0].max_rows == 5 and model[0].dense is not None
    model = torch.nn.Sequential(_linear(64, 128))
    quantize_linears(model, "int4", native=False)  # PyTorch's kernel: its own crossover
    assert model[0].max_rows == MAX_ROWS["int4"]
