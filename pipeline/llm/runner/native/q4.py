"""voxpipe's int4 CPU GEMM (``q4_vnni.c``): int4 weights × int8 activations on AVX-512 VNNI.

PyTorch's ``_weight_int4pack_mm_for_cpu`` converts every weight to fp32 and multiplies in
fp32, so it is bound by that arithmetic rather than by reading the weights, and it unpacks
each weight again for every block of 4 rows. ``q4_vnni.c`` quantizes the activations per
group of 32 to int8 (llama.cpp's Q8_0 scheme) and multiplies with ``vpdpbusd`` (16 outputs ×
4 weights per instruction), unpacking each weight tile once for up to 8 rows.

:func:`pack` lays out a weight for the kernel; :func:`gemm` and :func:`gemm_into` call it
through the package's library (:func:`pipeline.llm.runner.native.library`), and raise where
that library is not available: the callers (:class:`~pipeline.llm.runner.quant_linear.QuantLinear`)
check :func:`pipeline.llm.runner.native.available` first and use PyTorch's kernel otherwise.
"""

from __future__ import annotations

import torch

from pipeline.llm.runner import native

GROUP = 32
"""Weights per scale/min pair along K (fixed in the kernel)."""
TILE = 16
"""Outputs per tile (one 512-bit register of int32 sums)."""


def pack(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of ``W = q · scale + min``.

    Args:
        q: int ``[N, K]``, values 0..15; N a multiple of 16, K of 32.
        scale, mn: ``[N, K/32]``, any float dtype (stored fp16).

    Returns:
        ``(weights uint8 [N·K/2], scales_and_mins fp16 [N/16 · K/32 · 32])`` (the layout in
        ``q4_vnni.c``'s header).

    Raises:
        ValueError: a shape the kernel does not take.
    """
    n, k = q.shape
    if n % TILE or k % GROUP or scale.shape != (n, k // GROUP) or mn.shape != scale.shape:
        raise ValueError(f"int4 kernel does not take q {tuple(q.shape)}, scales {tuple(scale.shape)}")
    t, g = n // TILE, k // GROUP
    # k = 32 g + 8 p + 4 half + j  ->  [t, g, p, i, j, half]
    v = q.to(torch.uint8).reshape(t, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    w = (v[..., 0] | (v[..., 1] << 4)).contiguous().reshape(-1)
    sm = torch.stack([scale.to(torch.float16).reshape(t, TILE, g), mn.to(torch.float16).reshape(t, TILE, g)],
                     0)  # [2, t, i, g]
    return w, sm.permute(1, 3, 0, 2).contiguous().reshape(-1)  # [t, g, (scale|min), i]


def gemm(x: torch.Tensor, w: torch.Tensor, sm: torch.Tensor, n: int, *, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.float32, threads: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias``: ``x`` ``[M, K]`` (taken as contiguous bf16) → ``[M, N]`` in
    ``out_dtype`` (fp32, or bf16 rounded to nearest even).

    Args:
        x: activations; any float dtype (converted to bf16, the kernel's input).
        w, sm: :func:`pack`'s output for an ``[N, K]`` weight.
        n: N.
        bias: fp32 ``[N]`` (made fp32 contiguous) or None.
        out_dtype: ``torch.float32`` or ``torch.bfloat16``.
        threads: OpenMP threads (None: ``torch.get_num_threads()``).

    Raises:
        ValueError: ``x`` not 2-D on the CPU, ``w``/``sm``/``bias`` not :func:`pack`'s output
            for ``[n, K]``, or another ``out_dtype``.
        RuntimeError: the kernel is not available, or it rejected the shapes.
    """
    _entry()
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4 kernel writes fp32 or bf16, not {out_dtype}")
    if x.dim() != 2 or any(t.device.type != "cpu" for t in (x, w, sm)):
        raise ValueError(f"int4 kernel takes a 2-D CPU x, got {tuple(x.shape)} on {x.device}")
    if w.dtype != torch.uint8 or sm.dtype != torch.float16 or w.numel() * 2 != n * x.shape[1] or \
            sm.numel() != n * x.shape[1] // GROUP * 2:
        raise ValueError(f"weights packed for another shape than N={n}, K={x.shape[1]}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias of {bias.numel()} for N={n}")
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    y = torch.empty((x.shape[0], n), dtype=out_dtype)
    gemm_into(w, sm, bias, x, y, x.shape[0], threads)
    return y


def gemm_into(w: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor,
              rows: int, threads: int | None = None) -> None:
    """:func:`gemm` without the conversions, for the layers' hot path: ``x`` contiguous bf16
    ``[rows, K]`` (any leading shape), ``y`` contiguous fp32 or bf16 ``[rows, N]`` written in
    place, ``bias`` contiguous fp32 ``[N]`` or None. The caller guarantees dtypes and
    contiguity; shapes are checked by the kernel.

    Raises:
        RuntimeError: the kernel is not available, or it rejected the shapes.
    """
    fn = _entry()
    n, k = y.shape[-1], x.shape[-1]
    if w.numel() * 2 != n * k or x.numel() != rows * k or y.numel() != rows * n:  # cheap: the C code trusts them
        raise RuntimeError(f"int4 kernel: x {tuple(x.shape)}, y {tuple(y.shape)} do not fit "
                           f"weights of {w.numel()} bytes")
    rc = fn(w.data_ptr(), sm.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            rows, n, k, threads or torch.get_num_threads(), y.dtype is torch.bfloat16)
    if rc:
        raise RuntimeError(f"int4 kernel rejected x {tuple(x.shape)} for N={n}")


def _entry():
    """The kernel's ctypes function.

    Raises:
        RuntimeError: the kernel is not available.
    """
    lib = native.library()
    if lib is None:
        raise RuntimeError("int4 kernel not available")
    return lib.q4_gemm
