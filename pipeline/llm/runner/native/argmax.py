"""Greedy decoding's argmax over bf16 CPU logits (``argmax.c``).

``torch.argmax`` over a step's logits (rows × vocabulary, on an fp32 copy: bf16 directly is
slower) is a cost per row that continuous batching pays for every request in the step. The
kernel reads each bf16 logit once and gives torch.argmax's answer on the same values (first
index on ties, first NaN, 0 when all are -inf).
"""

from __future__ import annotations

import torch

from pipeline.llm.runner import native

MAX_COLUMNS = 2**31 - 1
"""Widest row the kernel takes (its lane indices are int32)."""


def argmax(logits: torch.Tensor) -> list[int] | None:
    """Per row, the index of its largest logit; None where the kernel does not take ``logits``.

    Args:
        logits: (rows, vocab). The kernel takes bf16 CPU rows with a contiguous last
            dimension, at least one row and column and at most :data:`MAX_COLUMNS` columns,
            not a lazily negated or conjugated view (its data are not its values).

    Returns:
        ``rows`` token ids, as torch.argmax on the fp32 values would give them; None where the
        kernel does not take the input or is not available (the caller runs PyTorch's).

    Raises:
        RuntimeError: the kernel rejected the shape (it takes any shape this function passes
            it, so this means a broken build).
    """
    if logits.dim() != 2 or logits.dtype is not torch.bfloat16 or logits.device.type != "cpu":
        return None
    rows, n = logits.shape
    lib = native.library()
    if lib is None or rows == 0 or n == 0 or n > MAX_COLUMNS or logits.stride(1) != 1 or logits.stride(0) < n or \
            logits.is_neg() or logits.is_conj():
        return None
    out = torch.empty(rows, dtype=torch.int64)
    if lib.argmax_bf16(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr()):
        raise RuntimeError(f"argmax kernel rejected logits of shape {tuple(logits.shape)}")
    return out.tolist()
