"""Several int4 projections of the same input in one kernel call (q/k/v, gate/up).

A decode step of Qwen2.5-0.5B calls voxpipe's int4 kernel 7 times per layer; three of those
calls (q, k, v) read the same activations, and two more (gate, up) another. Each call has a
fixed cost around the kernel (ctypes, the activations' int8 quantization, waking the OpenMP
team) that adds up over a batch-1 step (docs/BENCHMARKS.md). :class:`FusedQuant` lays the layers'
packed weight tiles end to end (the kernel's layout is tile-major, 16 outputs per tile, so
concatenating the packed arrays is the packed array of the stacked weight) and runs them in
one call; each output column is computed exactly as in its own layer's call (same tile
arithmetic, same per-row int8 activations), so the result is bit-identical.

The layers keep working alone: their packed buffers become views into the fused ones (no
second copy of the weights).
"""

from __future__ import annotations

import torch

from pipeline.llm.runner.native import q4
from pipeline.llm.runner.quant_linear import QuantLinear


class FusedQuant:
    """The outputs of ``layers`` (each ``(..., K)`` bf16 → ``(..., N_i)``) from one kernel call.

    Built by :meth:`of`; steps of more than the layers' ``max_rows`` rows run each layer's
    bf16 copy, as the layers would.
    """

    def __init__(self, layers: list[QuantLinear]) -> None:
        self.layers = layers
        self.sizes = [lyr.out_features for lyr in layers]
        self.n, self.k, self.max_rows = sum(self.sizes), layers[0].in_features, layers[0].max_rows
        self.qweight = torch.cat([lyr.qweight for lyr in layers])
        self.qscale = torch.cat([lyr.qscale for lyr in layers])
        biases = [lyr.bias_f32 for lyr in layers]
        self.bias = None if any(b is None for b in biases) else torch.cat(biases)  # type: ignore[arg-type]
        w_at = s_at = 0
        for lyr in layers:  # the layers read their slices of the fused buffers from now on
            nw, ns = lyr.qweight.numel(), lyr.qscale.numel()
            lyr.qweight = self.qweight[w_at:w_at + nw]
            lyr.qscale = self.qscale[s_at:s_at + ns]
            w_at, s_at = w_at + nw, s_at + ns

    @classmethod
    def of(cls, layers: list) -> FusedQuant | None:
        """A fused call for ``layers``, or None unless every one is a :class:`QuantLinear` on
        voxpipe's int4 kernel with the same input width and ``max_rows``, and either all have
        a bias or none has."""
        if len(layers) < 2 or not all(isinstance(lyr, QuantLinear) and lyr.native for lyr in layers):
            return None
        if len({(lyr.in_features, lyr.max_rows, lyr.bias_f32 is None) for lyr in layers}) != 1:
            return None  # (a zero bias for an unbiased layer would turn its -0.0 outputs into +0.0)
        return cls(layers)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output for ``x`` ``(..., K)``: views of one ``(..., sum N_i)`` bf16 tensor
        (the last dimension split; each view's last dimension is contiguous)."""
        rows = x.numel() // self.k
        if self.max_rows is not None and rows > self.max_rows:
            return tuple(lyr.forward(x) for lyr in self.layers)
        xb = x if x.dtype is torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
        y = torch.empty((*x.shape[:-1], self.n), dtype=torch.bfloat16)
        q4.gemm_into(self.qweight, self.qscale, self.bias, xb, y, rows)
        outs = y.split(self.sizes, dim=-1)
        return outs if x.dtype is torch.bfloat16 else tuple(o.to(x.dtype) for o in outs)
