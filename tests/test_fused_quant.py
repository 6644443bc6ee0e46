"""Fused int4 projections (pipeline/llm/runner/fused_quant.py): one kernel call gives the
same bits as each layer's own call, the layers keep working on views of the fused weights
(no second copy), wide steps run the layers' bf16 copies, and only layers that can fuse do."""

from __future__ import annotations

import pytest
import torch

from pipeline.llm.runner import native
from pipeline.llm.runner.fused_quant import FusedQuant
from pipeline.llm.runner.quant_linear import QuantLinear


def _layers(sizes, k=96, bias=(True, True, True), max_rows=8, seed=0):
    torch.manual_seed(seed)
    out = []
    for n, b in zip(sizes, bias):
        lin = torch.nn.Linear(k, n, bias=b).to(torch.bfloat16)
        out.append(QuantLinear(lin, "int4", max_rows=max_rows))
    return out


@pytest.mark.native
@pytest.mark.parametrize("bias", [(True, True, True), (False, False, False)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_one_call_gives_each_layers_own_bits(bias, rows):
    layers = _layers([64, 32, 48], bias=bias)
    x = torch.randn(rows, 1, 96).bfloat16()
    alone = [lyr.forward(x) for lyr in layers]
    fused = FusedQuant.of(layers)
    assert fused is not None
    together = fused(x)
    for a, t in zip(alone, together):
        assert t.shape == a.shape and torch.equal(t, a)
    for a, lyr in zip(alone, layers):  # the layers, now on views of the fused weights, agree too
        assert torch.equal(lyr.forward(x), a)


@pytest.mark.native
def test_the_layers_share_the_fused_weights():
    layers = _layers([64, 32, 48])
    fused = FusedQuant.of(layers)
    assert fused is not None
    base, end = fused.qweight.data_ptr(), fused.qweight.data_ptr() + fused.qweight.numel()
    assert all(base <= lyr.qweight.data_ptr() < end for lyr in layers)
    assert sum(lyr.qweight.numel() for lyr in layers) == fused.qweight.numel()


@pytest.mark.native
def test_a_wide_step_runs_each_layers_bf16_copy():
    layers = _layers([64, 32], bias=(True, True), max_rows=2)
    fused = FusedQuant.of(layers)
    x = torch.randn(5, 96).bfloat16()
    for t, lyr in zip(fused(x), layers):  # type: ignore[misc]
        assert torch.equal(t, lyr.dense(x))  # type: ignore[misc]


def test_only_layers_on_the_int4_kernel_with_one_input_width_fuse():
    lin = torch.nn.Linear(96, 32).to(torch.bfloat16)
    assert FusedQuant.of([lin, lin]) is None
    assert FusedQuant.of([QuantLinear(lin, "int8", max_rows=8)] * 2) is None
    assert FusedQuant.of([QuantLinear(lin, "int4", max_rows=8, native=False)] * 2) is None
    if native.available():
        other = QuantLinear(torch.nn.Linear(64, 32).to(torch.bfloat16), "int4", max_rows=8)
        assert FusedQuant.of([QuantLinear(lin, "int4", max_rows=8), other]) is None
        assert FusedQuant.of(_layers([32])) is None
        # one with a bias, one without: a zero bias would turn -0.0 into +0.0, so no fusing
        assert FusedQuant.of(_layers([32, 16], bias=(True, False))) is None
