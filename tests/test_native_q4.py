"""voxpipe's int4 CPU kernel (pipeline/llm/runner/native/q4.py, q4_vnni.c): its packed layout,
its arithmetic against a float64 reference of the same scheme (int4 weights with fp16 scale
and min per 32, int8 activations per 32), row independence (continuous batching gives each
request the tokens it would get alone), threads, bf16 output and bias, and the fallback to
PyTorch's kernel. The build, its cache and the switch: tests/test_native_build.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.llm.runner.native import q4
from pipeline.llm.runner.quant_linear import QuantLinear, quantize_int4_min


def _unpack(w: torch.Tensor, sm: torch.Tensor, n: int, k: int):
    """The reference reading of the packed layout (q4_vnni.c's header): q, scale, min."""
    t, g = n // 16, k // 32
    b = w.reshape(t, g, 4, 16, 4)  # [t, g, p, i, j]
    lo, hi = (b & 0x0F).long(), (b >> 4).long()
    q = torch.stack([lo, hi], -2)  # [t, g, p, i, half, j]: k = 32 g + 8 p + 4 half + j
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(n, k)
    s = sm.reshape(t, g, 2, 16).permute(2, 0, 3, 1).reshape(2, n, g)
    return q, s[0], s[1]


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """float64 y = Σ_g scale·d·Σ q·xq + min·Σ x, activations quantized as the kernel does."""
    xf = x.double().reshape(x.shape[0], -1, 32)
    d = xf.abs().amax(-1, keepdim=True) / 127
    xq = torch.where(d > 0, torch.round(xf.float() * torch.where(d > 0, 1 / d.float(), 0.0)).double(), 0.0)
    n, k = q.shape
    qg = q.double().reshape(n, k // 32, 32)
    dot = torch.einsum("mgk,ngk->mng", xq, qg)  # [M, N, G]
    return (dot * d[..., 0][:, None, :] * scale.double()[None] + mn.double()[None] * xf.sum(-1)[:, None, :]).sum(-1)


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :32] *= 20  # groups of very different ranges
    return quantize_int4_min(w)


@given(n=st.sampled_from([16, 48, 128]), k=st.sampled_from([32, 96, 256]), seed=st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_packing_keeps_every_weight_scale_and_min(n, k, seed):
    q, scale, mn = _weights(n, k, seed)
    w, sm = q4.pack(q, scale, mn)
    assert w.dtype == torch.uint8 and w.numel() == n * k // 2 and sm.dtype == torch.float16
    q2, s2, m2 = _unpack(w, sm, n, k)
    assert torch.equal(q2, q.long()) and torch.equal(s2, scale) and torch.equal(m2, mn)


def test_quantization_is_within_half_a_step_of_the_weight():
    w = torch.randn(64, 128) * 0.1
    q, scale, mn = quantize_int4_min(w)
    assert int(q.min()) >= 0 and int(q.max()) <= 15
    deq = (q.float().reshape(64, 4, 32) * scale.float()[..., None] + mn.float()[..., None]).reshape(64, 128)
    step = scale.float().repeat_interleave(32, 1)
    assert ((deq - w).abs() <= step * 0.5 + 1e-3 * w.abs().max()).all()  # + fp16 rounding of scale, min


def test_pack_rejects_shapes_the_kernel_does_not_take():
    q, s, m = _weights(32, 64, 0)
    with pytest.raises(ValueError, match="does not take"):
        q4.pack(q[:24], s[:24], m[:24])  # N not a multiple of 16
    with pytest.raises(ValueError, match="does not take"):
        q4.pack(q, s[:, :1], m[:, :1])  # scales of the wrong shape
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_int4_min(torch.randn(16, 40))


@pytest.mark.native
@given(rows=st.integers(1, 20), n=st.sampled_from([16, 32, 80]), k=st.sampled_from([32, 64, 160]),
       seed=st.integers(0, 10_000), zero_row=st.booleans())
@settings(max_examples=40, deadline=None)
def test_gemm_matches_the_float64_reference_of_its_scheme(rows, n, k, seed, zero_row):
    q, scale, mn = _weights(n, k, seed)
    w, sm = q4.pack(q, scale, mn)
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + 1)) * 2).to(torch.bfloat16)
    if zero_row:
        x[0] = 0  # d = 0: no division by zero, y = 0
    y = q4.gemm(x, w, sm, n, threads=1)
    ref = _reference(x, q, scale, mn)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    assert torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-6)
    if zero_row:
        assert not y[0].any()


@pytest.mark.native
@given(seed=st.integers(0, 10_000), rows=st.integers(2, 19), pick=st.integers(0, 18))
@settings(max_examples=25, deadline=None)
def test_a_row_gets_the_same_bits_whatever_rows_share_its_step(seed, rows, pick):
    # continuous batching: a request's tokens must not depend on who else decodes with it
    q, scale, mn = _weights(64, 128, seed)
    w, sm = q4.pack(q, scale, mn)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    i = pick % rows
    together = q4.gemm(x, w, sm, 64, threads=1)
    alone = q4.gemm(x[i:i + 1], w, sm, 64, threads=1)
    assert torch.equal(together[i:i + 1], alone)
    assert torch.equal(q4.gemm(x, w, sm, 64, threads=2), together)


@pytest.mark.native
def test_bf16_output_is_the_fp32_result_rounded_and_bias_is_added():
    q, scale, mn = _weights(48, 96, 3)
    w, sm = q4.pack(q, scale, mn)
    x = torch.randn(5, 96).to(torch.bfloat16)
    bias = torch.randn(48)
    y32 = q4.gemm(x, w, sm, 48, bias=bias)
    assert torch.allclose(y32, q4.gemm(x, w, sm, 48) + bias, rtol=1e-6, atol=1e-6)
    y16 = q4.gemm(x, w, sm, 48, bias=bias, out_dtype=torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16))  # round to nearest even
    # fp32 activations are taken as bf16, as the model would send them
    assert torch.equal(q4.gemm(x.float(), w, sm, 48), q4.gemm(x, w, sm, 48))


@pytest.mark.native
def test_the_kernel_rejects_a_k_it_was_not_built_for():
    q, scale, mn = _weights(16, 64, 0)
    w, sm = q4.pack(q, scale, mn)
    with pytest.raises(ValueError, match="another shape"):
        q4.gemm(torch.zeros(1, 48, dtype=torch.bfloat16), w, sm, 16)
    with pytest.raises(RuntimeError, match="rejected"):  # the C side checks too
        q4.gemm_into(w, sm, None, torch.zeros(1, 16, dtype=torch.bfloat16),  # K 16: not groups of 32
                            torch.empty(1, 64, dtype=torch.bfloat16), 1)


@pytest.mark.native
def test_quant_linear_runs_the_kernel_within_int4_error_of_the_layer():
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    ql = QuantLinear(lin, "int4")
    assert ql.native and ql.group == 32 and "q4_vnni" in repr(ql)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    y = ql(x)
    assert y.shape == (2, 3, 96) and y.dtype == torch.bfloat16
    ref = lin(x).float()
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert rel < 0.1, rel  # uniform weights: int4 steps of range/15 give ~7 %
    aten = QuantLinear(lin, "int4", native=False)
    assert not aten.native and ((aten(x).float() - ref).norm() / ref.norm()).item() < 0.1


@pytest.mark.native
def test_gemm_refuses_arguments_that_do_not_fit_its_weights():
    q, scale, mn = _weights(64, 128, 0)
    w, sm = q4.pack(q, scale, mn)
    x = torch.randn(3, 128).to(torch.bfloat16)
    for kwargs, n, xx in (({"out_dtype": torch.float16}, 64, x), ({}, 640000, x), ({}, 64, torch.randn(3, 4096)),
                          ({"bias": torch.randn(16)}, 64, x), ({}, 64, torch.randn(128))):
        with pytest.raises(ValueError):
            q4.gemm(xx, w, sm, n, **kwargs)
    with pytest.raises(RuntimeError, match="do not fit"):
        q4.gemm_into(w, sm, None, x, torch.empty(3, 32, dtype=torch.bfloat16), 3)


def test_weights_beyond_fp16_take_pytorchs_kernel():
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight[0, 0] = -70000.0
    with pytest.raises(ValueError, match="fp16"):
        quantize_int4_min(lin.weight)
    ql = QuantLinear(lin, "int4")
    assert not ql.native and ql.group == 32
    y = ql(torch.ones(1, 64).to(torch.bfloat16))
    assert y.float().isfinite().all()
