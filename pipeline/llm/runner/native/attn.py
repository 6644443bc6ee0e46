"""voxpipe's decode attention kernel (``decode_attn.c``): one query token per row, on AVX-512.

:func:`pipeline.llm.runner.mixed_attention.decode_attention` runs each row as two fp32
matmuls and a softmax in PyTorch: eight small ops per row and layer, whose dispatch, not
their arithmetic, dominates at decode shapes. The C kernel does the same work in one call per
layer: a task per (row, KV head) reads each key and value row once for all of that KV head's
query heads, sums in fp32 over exactly the row's own columns, and depends on nothing else in
the batch or on the thread count, so a row gets the same bits in a batch as alone (what the
PyTorch version gives, by the same rule).

It runs from the package's library (:func:`pipeline.llm.runner.native.library`); where that
is not available (``VOXPIPE_NATIVE=0``, the CPU, no compiler) :func:`attend` returns None and
the caller runs the PyTorch version.
"""

from __future__ import annotations

import functools

import torch

from pipeline.llm.runner import native

MAX_HEAD_DIM = 256
"""Largest head dimension the kernel takes (a multiple of 16)."""
MAX_GROUP = 256
"""Most query heads per KV head the kernel takes."""


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: list[int], scale: float,
           threads: int | None = None, ends: list[int] | None = None) -> torch.Tensor | None:
    """Attention of one query token per row over columns ``[starts[b], ends[b])`` of its
    keys/values (``ends`` None: to T).

    Args:
        query: (B, H, 1, D) bf16. key, value: (B, KV, T, D) bf16, H a multiple of KV; any
            strides with the last dimension contiguous (a stride of 0 over B: rows sharing
            one KV, the tokens of a prompt chunk, see :func:`chunk`).
        starts: per row, its first attended column (0 <= start < T).
        scale: score scale (1/sqrt(D) for plain attention).
        threads: OpenMP threads (default: torch's intra-op count).
        ends: per row, one past its last attended column (start < end <= T).

    Returns:
        (B, 1, H, D) bf16, contiguous; None where the kernel does not take the inputs (not
        available; not all three bf16 on the CPU; shapes that do not fit one another; an
        empty dimension; D not a multiple of 16 or over 256; over 256 query heads per KV
        head; a last dimension that is not contiguous; a start or end out of range).
    """
    if query.dim() != 4 or key.dim() != 4 or value.shape != key.shape:
        return None
    b, h, q_len, d = query.shape
    kv, t = key.shape[1], key.shape[2]
    if q_len != 1 or 0 in (b, kv, t, d) or d % 16 or d > MAX_HEAD_DIM or key.shape[3] != d or key.shape[0] != b or \
            h % kv or h // kv > MAX_GROUP or len(starts) != b or min(starts) < 0 or max(starts) >= t:
        return None
    if ends is not None and (len(ends) != b or max(ends) > t or any(s >= e for s, e in zip(starts, ends))):
        return None
    bf16 = torch.bfloat16
    lib = native.library()
    if lib is None or any(x.dtype is not bf16 or x.device.type != "cpu" or x.stride(-1) != 1
                          for x in (query, key, value)):
        return None
    out = torch.empty((b, 1, h, d), dtype=bf16)
    st = _int32(tuple(starts))
    en = None if ends is None else _int32(tuple(ends))
    rc = lib.attn_decode(
        query.data_ptr(), query.stride(0), query.stride(1),
        key.data_ptr(), key.stride(0), key.stride(1), key.stride(2),
        value.data_ptr(), value.stride(0), value.stride(1), value.stride(2),
        st.data_ptr(), None if en is None else en.data_ptr(), out.data_ptr(), b, h, kv, t, d, scale,
        threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"decode attention kernel rejected q {tuple(query.shape)}, k {tuple(key.shape)}")
    return out


def chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
          threads: int | None = None) -> torch.Tensor | None:
    """Causal attention of a prompt chunk over its own KV (its past, then itself): token i of
    n sees columns ``[0, T - n + i]``. Each token is a row of :func:`attend` over the one
    shared KV (a stride of 0), so a chunk costs one call per layer instead of PyTorch's SDPA
    with transformers' GQA expansion around it.

    Args:
        query: (1, H, n, D) bf16, last dimension contiguous. key, value: (1, KV, T, D) bf16,
            T >= n.

    Returns:
        (1, n, H, D) bf16, or None where :func:`attend` does not take the inputs.
    """
    if query.dim() != 4 or key.dim() != 4 or query.shape[0] != 1 or key.shape[0] != 1:
        return None
    _, h, n, d = query.shape
    t = key.shape[2]
    if n == 0 or t < n:
        return None
    rows = query[0].transpose(0, 1)[:, :, None]  # (n, H, 1, D)
    out = attend(rows, key.expand(n, -1, -1, -1), value.expand(n, -1, -1, -1), [0] * n, scale, threads,
                 ends=list(range(t - n + 1, t + 1)))
    return None if out is None else out.view(1, n, h, d)


@functools.lru_cache(maxsize=16)
def _int32(values: tuple[int, ...]) -> torch.Tensor:
    """``values`` as an int32 tensor for C (read only there). Every layer of a step asks for
    the same few lists (the decoding rows' starts; a chunk's starts and ends), so they are
    kept rather than built again in each layer."""
    return torch.tensor(values, dtype=torch.int32)
