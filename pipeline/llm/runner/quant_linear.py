"""Weight-only quantized linear layers for CPU decode (``--device cpu-int4`` / ``cpu-int8``).

A CPU decode step reads every weight once per token, so at batch 1 it is bound by memory
traffic; 4-bit weights cut that traffic ~4×. PyTorch ships the CPU kernels:

* int4, group-wise, asymmetric: ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``
  packs an int32 ``[N, K]`` matrix of values 0..15 into uint8 ``[N, K/2]``;
  ``torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)``
  computes ``x @ W.T`` with ``W[n, k] = (q[n, k] − 8) · scale[g, n] + zero[g, n]``,
  ``g = k // group``, ``scales_and_zeros`` ``[K/group, N, 2]`` in x's dtype (the tinygemm
  layout; aten/src/ATen/native/cpu/int4mm_kernel.cpp; the "−8" is also spelled out in
  torch/_inductor/codegen/cpp_gemm_template.py). Shapes it takes: N a multiple of 16,
  K a multiple of the group.
* int8, per output channel, symmetric: ``torch.ops.aten._weight_int8pack_mm(x, q, scales)``
  with ``q`` int8 ``[N, K]`` and ``scales`` ``[N]`` in x's dtype.

Where the CPU has AVX-512 VNNI and a C compiler is found, int4 layers run voxpipe's own
kernel instead (:mod:`~pipeline.llm.runner.native.q4`: int8 activations, ``vpdpbusd``, fp16
scale and min per group of 32), which reads the weights at the memory bandwidth at batch 1,
unpacks them once for up to 8 rows and, without AMX, beats oneDNN bf16 at every width, so
there it runs every step and no bf16 copy is kept (:func:`native_max_rows`); the paragraph
below is about PyTorch's kernels.

Both PyTorch kernels dequantize inside the inner loop, so their cost grows with the rows of ``x``:
int4 beats oneDNN bf16 clearly at 1 row, less at 4, ties near 8 and loses wider; int8 only
about ties at 1 row (the crossover table is in docs/BENCHMARKS.md). So each layer keeps its
oneDNN-packed bf16 weight too (:class:`~pipeline.llm.runner.cpu_linear.PackedLinear`)
and takes the quantized kernel only for steps of at most ``max_rows`` rows (decode of a few
rows); prefill chunks and wide batches run in bf16. ``max_rows=None`` drops the bf16 copy
(quantized kernel for every shape, the smallest memory).

``torch.ops.aten._dyn_quant_matmul_4bit`` (KleidiAI, dynamic int8 activations) is an Arm
kernel: on x86 torch 2.13 runs a reference loop, about two orders of magnitude slower than
the int4 kernel, so it is not used.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pipeline.llm.runner import native as native_kernels
from pipeline.llm.runner.cpu_linear import PackedLinear, packing_supported
from pipeline.llm.runner.native import cpu, q4

logger = logging.getLogger(__name__)

INT4_GROUP_SIZE = 32
"""Default int4 group (weights per scale/zero pair): the GGUFs' own block (Q4_1, Q5_0, Q8_0
blocks and Q4_K sub-blocks are 32 weights), so SmolLM2's Q4_1 layers come back exactly (0.4 %
relative error against the bf16 weights: bf16 rounding; Qwen's 5-bit Q5_0 layers: 8 %). Its
extra half-bit per weight of scales costs little kernel time against groups of 64 or 128
(docs/BENCHMARKS.md)."""

GROUP_SIZES = (32, 64, 128)
"""Int4 groups the kernel takes (a layer whose K no group divides stays bf16)."""

MAX_ROWS = {"int4": 4, "int8": 1}
"""Default rows per step up to which PyTorch's quantized kernel runs (above: the bf16 copy),
from the crossover above (int4 wins up to 4 rows, ties at 8; int8 wins only at 1)."""

NATIVE_MAX_ROWS = 8
"""Rows per step up to which voxpipe's int4 kernel runs on a CPU with AMX (see
:func:`native_max_rows`); it unpacks each weight tile once for up to 8 rows."""

AMX_FLAGS = ("amx_bf16", "amx_tile")
"""``/proc/cpuinfo`` flags of Intel's AMX tile unit, on which oneDNN's bf16 GEMM runs."""


def native_max_rows(cpuinfo: str | None = None) -> int | None:
    """Default ``max_rows`` for layers on voxpipe's int4 kernel: None (the kernel for every
    step, no bf16 copy kept) unless the CPU has AMX (:data:`AMX_FLAGS`), then
    :data:`NATIVE_MAX_ROWS`.

    On a CPU without AMX the kernel beat oneDNN bf16 at every width from 1 to 256 rows
    (docs/KERNELS.md has the table). Without AMX, bf16 multiplies on the same AVX-512 units
    (``vdpbf16ps``, 32 products per instruction) as the kernel's ``vpdpbusd`` (64), so the
    kernel wins at every width, prefill chunks included, and the bf16 copy (the size of the
    bf16 weights) buys nothing. AMX's tile multiply is built for wide bf16 GEMMs; there, steps of more than
    :data:`NATIVE_MAX_ROWS` rows keep the bf16 copy (no AMX machine was at hand to measure).
    """
    return NATIVE_MAX_ROWS if cpu.cpu_flags(cpuinfo).issuperset(AMX_FLAGS) else None


KINDS = ("int4", "int8")

SKIP = ("embed_tokens",)
"""Module names never quantized (the input embedding is a lookup, not a linear)."""


_ROWS = 256


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 quantization of ``w`` ``[N, K]`` in groups of ``group`` along K.

    Returns ``(q, scales_and_zeros)``: ``q`` int32 ``[N, K]`` in 0..15 and bf16
    ``[K/group, N, 2]`` (scale, zero) such that ``W ≈ (q − 8) · scale + zero`` (the layout
    ``_weight_int4pack_mm_for_cpu`` reads). Scale = (max − min)/15 per group (torchao's
    ``get_groupwise_affine_qparams``), zero = min + 8 · scale.

    Raises:
        ValueError: ``w`` not 2-D or K not a multiple of ``group``.
    """
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"int4 needs a 2-D weight with K a multiple of {group}, got {tuple(w.shape)}")
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int32)
    sz = torch.empty((n, k // group, 2), dtype=torch.bfloat16)
    for r in range(0, n, _ROWS):  # row blocks: the fp32 temporaries stay in cache
        wg = w[r:r + _ROWS].detach().to(torch.float32, copy=True).reshape(-1, k // group, group)
        lo, hi = torch.aminmax(wg, dim=-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp_(min=1e-6).to(torch.bfloat16).float()
        zero = (lo + 8 * scale).to(torch.bfloat16).float()
        # round against the bf16 scale and zero the kernel will use
        q[r:r + _ROWS] = wg.sub_(zero).div_(scale).add_(8).round_().clamp_(0, 15).reshape(-1, k)
        sz[r:r + _ROWS] = torch.cat([scale, zero], -1)
    return q, sz.transpose(0, 1).contiguous()


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight :func:`quantize_int4`'s output stands for (the reference)."""
    n, k = q.shape
    s, z = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K/group] each
    return ((q.float().reshape(n, k // group, group) - 8) * s[..., None] + z[..., None]).reshape(n, k)


def quantize_int4_min(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max int4 of ``w`` ``[N, K]`` in groups of 32 along K for voxpipe's kernel
    (:mod:`~pipeline.llm.runner.native.q4`).

    Returns ``(q int32 [N, K] in 0..15, scale fp16 [N, K/32], min fp16 [N, K/32])`` with
    ``W ≈ q · scale + min``; q is rounded against the fp16 scale and min the kernel reads.

    Raises:
        ValueError: ``w`` not 2-D, K not a multiple of 32, or a scale or min beyond fp16's
            range.
    """
    g = q4.GROUP
    if w.dim() != 2 or w.shape[1] % g:
        raise ValueError(f"int4 needs a 2-D weight with K a multiple of {g}, got {tuple(w.shape)}")
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int32)
    scale = torch.empty((n, k // g), dtype=torch.float16)
    mn = torch.empty((n, k // g), dtype=torch.float16)
    for r in range(0, n, _ROWS):
        wg = w[r:r + _ROWS].detach().to(torch.float32, copy=True).reshape(-1, k // g, g)
        lo, hi = torch.aminmax(wg, dim=-1, keepdim=True)
        s = ((hi - lo) / 15).clamp_(min=1e-6).to(torch.float16).float()
        lo = lo.to(torch.float16).float()
        q[r:r + _ROWS] = wg.sub_(lo).div_(s).round_().clamp_(0, 15).reshape(-1, k)
        scale[r:r + _ROWS], mn[r:r + _ROWS] = s[..., 0], lo[..., 0]
    if not (scale.isfinite().all() and mn.isfinite().all()):
        raise ValueError("int4 scales or mins beyond fp16's range (a weight of magnitude > 65504)")
    return q, scale, mn


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(q int8 [N, K], scales bf16 [N])``,
    ``W ≈ q · scale``, scale = max|row| / 127."""
    scale = (w.detach().float().abs().amax(1) / 127).clamp(min=1e-8).to(torch.bfloat16).float()
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


class QuantLinear(torch.nn.Module):
    """A weight-only quantized ``nn.Linear`` (bf16 activations in and out).

    Input ``(..., in_features)`` bf16 → ``(..., out_features)`` bf16. Steps of at most
    ``max_rows`` rows (the product of the leading dims) run the quantized kernel, larger
    ones the bf16 copy (``max_rows=None``: always quantized, no copy kept). Int4 runs
    voxpipe's kernel (``native``; None: where :func:`~pipeline.llm.runner.native.available`), else PyTorch's.

    Raises (at construction):
        ValueError: an unknown kind, a shape the kernel does not take (N not a multiple of 16
            for int4, K not a multiple of any group in :data:`GROUP_SIZES`), or a kernel that
            rejects the layer on a probe call.
    """

    def __init__(self, lin: torch.nn.Linear, kind: str, *, group: int = INT4_GROUP_SIZE,
                 max_rows: int | None = None, native: bool | None = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown quantization {kind!r}: use one of {KINDS}")
        w = lin.weight.detach()
        self.kind, self.in_features, self.out_features = kind, lin.in_features, lin.out_features
        self.max_rows = max_rows
        self.group = 0
        self.native = False
        if kind == "int4":
            self.native = (native_kernels.available() if native is None else native) and \
                self.in_features % q4.GROUP == 0 and self.out_features % q4.TILE == 0
            aten_group = next((g for g in (group, *GROUP_SIZES) if self.in_features % g == 0), 0)
            if self.out_features % 16 or not (self.native or aten_group):
                raise ValueError(f"int4 kernel does not take a {self.out_features}x{self.in_features} weight")
            if self.native:
                try:
                    self._register_native(w)
                    self.group = q4.GROUP
                except ValueError:  # weights fp16 cannot scale: PyTorch's kernel (bf16 scales)
                    self.native = False
            if not self.native:
                self.group = aten_group
                q, sz = quantize_int4(w, self.group)
                self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
                self.register_buffer("qscale", sz)
        else:
            q8, s8 = quantize_int8(w)
            self.register_buffer("qweight", q8)
            self.register_buffer("qscale", s8)
        self.bias: torch.Tensor | None
        self.qweight: torch.Tensor
        self.qscale: torch.Tensor
        self.register_buffer("bias", None if lin.bias is None else lin.bias.detach().to(torch.bfloat16))
        self.bias_f32 = None if self.bias is None else self.bias.float()
        self.dense: torch.nn.Module | None = None
        if max_rows is not None:
            self.dense = PackedLinear(lin) if packing_supported() else lin
        try:
            self._quantized(torch.zeros(1, self.in_features, dtype=torch.bfloat16))
        except RuntimeError as exc:
            raise ValueError(f"{kind} kernel rejects a {self.out_features}x{self.in_features} weight: {exc}") from exc

    def _register_native(self, w: torch.Tensor) -> None:
        packed, scales = q4.pack(*quantize_int4_min(w))
        self.register_buffer("qweight", packed)
        self.register_buffer("qscale", scales)

    def _quantized(self, x2: torch.Tensor) -> torch.Tensor:
        if self.native:
            return q4.gemm(x2, self.qweight, self.qscale, self.out_features, bias=self.bias_f32,
                                  out_dtype=torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.qscale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.qscale)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.dense is not None and self.max_rows is not None and rows > self.max_rows:
            return self.dense(x)
        if self.native:  # the lean path: a decode step calls ~170 of these
            xb = x if x.dtype is torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()
            y = torch.empty((*x.shape[:-1], self.out_features), dtype=torch.bfloat16)
            q4.gemm_into(self.qweight, self.qscale, self.bias_f32, xb, y, rows)
            return y if x.dtype is torch.bfloat16 else y.to(x.dtype)
        y = self._quantized(x.reshape(rows, self.in_features).to(torch.bfloat16).contiguous())
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.kind}, in={self.in_features}, out={self.out_features}, group={self.group}, "
                f"max_rows={self.max_rows}, kernel={'voxpipe q4_vnni' if self.native else 'aten'}")


@dataclass(slots=True)
class QuantReport:
    """What :func:`quantize_linears` did: layer names quantized and kept bf16 (with why)."""

    kind: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    native: int = 0  # layers on voxpipe's int4 kernel (the rest of the int4 ones: PyTorch's)

    def __str__(self) -> str:
        kernels = ""
        if self.kind == "int4" and self.quantized:
            aten = len(self.quantized) - self.native
            kernels = f" ({self.native} on voxpipe's q4_vnni kernel, {aten} on PyTorch's)"
        return (f"{self.kind}: {len(self.quantized)} linear layers quantized{kernels}, {len(self.kept)} kept bf16"
                + (f" ({', '.join(sorted(self.kept))})" if self.kept else ""))


def quantize_linears(model: torch.nn.Module, kind: str, *, group: int = INT4_GROUP_SIZE,
                     max_rows: int | None | str = "default", lm_head: bool | None = None,
                     native: bool | None = None) -> QuantReport:
    """Replace the bf16 CPU ``nn.Linear`` layers of ``model`` by :class:`QuantLinear`, in place.

    Args:
        model: a transformers causal LM with bf16 weights on the CPU.
        kind: ``int4`` or ``int8``.
        group: preferred int4 group (a layer whose K it does not divide takes the next of
            :data:`GROUP_SIZES` that does).
        max_rows: rows per step up to which the quantized kernel runs (by default
            :func:`native_max_rows` with voxpipe's int4 kernel, else :data:`MAX_ROWS`; None:
            always, and no bf16 copy kept).
        lm_head: quantize the output projection too (the embedding never is). None
            (default): only when it is its own tensor, not tied to the input embedding.
            Measured (bench/llm_quant.py, perplexity of bf16's greedy replies, int4 / bf16):
            SmolLM2 (tied head, Q8_0 in its GGUF: int4 loses ~9 % of it, relative Frobenius
            error, against ~0.4 % for its Q4_1 layers, which int4 group 32 recovers exactly)
            1.001 with the head in bf16, 1.066 with it in int4; Qwen2.5-0.5B (own Q8_0 head,
            27 % of the weights read per token) 1.035 and 1.033 on 20 prompts (1.044 on all
            46 with the head in int4).
        native: int4 through voxpipe's kernel (:mod:`~pipeline.llm.runner.native.q4`); None:
            where it is available.

    Returns:
        A :class:`QuantReport`. Layers the kernels do not take stay as they were (bf16) and
        are listed in ``kept``; the rest of the model is untouched.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown quantization {kind!r}: use one of {KINDS}")
    if max_rows == "default":
        max_rows = native_max_rows() if kind == "int4" and native is not False and native_kernels.available() \
            else MAX_ROWS[kind]
    rows = max_rows
    assert rows is None or isinstance(rows, int)
    report = QuantReport(kind)
    get_head, get_emb = (getattr(model, f, None) for f in ("get_output_embeddings", "get_input_embeddings"))
    head = get_head() if callable(get_head) else None
    if lm_head is None:
        emb = get_emb() if callable(get_emb) else None
        lm_head = head is not None and (emb is None or head.weight is not emb.weight)
    todo = [(f"{pname}.{name}".lstrip("."), parent, name, child) for pname, parent in model.named_modules()
            for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu"]
    for full, parent, name, child in todo:
        if name in SKIP or (child is head and not lm_head):
            report.kept[full] = "not quantized by choice"
            continue
        try:
            ql = QuantLinear(child.to(torch.bfloat16), kind, group=group, max_rows=rows, native=native)
            setattr(parent, name, ql)
            report.quantized.append(full)
            report.native += ql.native
        except ValueError as exc:
            report.kept[full] = str(exc)
            logger.warning("kept %s in bf16: %s", full, exc)
    return report


def any_width(model: torch.nn.Module) -> bool:
    """True when every linear layer of ``model`` except its output head is a
    :class:`QuantLinear` on voxpipe's int4 kernel with no row limit: then no step goes
    through oneDNN's linears, which compile a kernel per token count, and steps need not be
    padded to a few token counts (:attr:`~pipeline.llm.runner.runner.ModelRunner.BUCKET`)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantLinear)) and m is not head]
    return bool(layers) and all(isinstance(m, QuantLinear) and m.native and m.max_rows is None for m in layers)
