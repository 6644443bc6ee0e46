"""Greedy decoding's argmax: voxpipe's C kernel (``argmax.c``) on bf16 CPU logits, else PyTorch.

At batch 8 a Qwen2.5-0.5B decode step spent ~1 ms of ~30 in ``torch.argmax`` over the
8 × 151936 logits (on an fp32 copy; bf16 directly was 2× slower): a cost per row, which
continuous batching pays for every request in the step. The kernel reads each bf16 logit
once and gives torch.argmax's answer (first index on ties, first NaN, 0 when all are -inf).
It is compiled into :mod:`~pipeline.llm.runner.q4_native`'s library (same build, cache and
``VOXPIPE_NATIVE_INT4=0`` switch).
"""

from __future__ import annotations

import torch

from pipeline.llm.runner import q4_native

_MAX_COLUMNS = 2**31 - 1
"""Widest row the kernel takes (its lane indices are int32); wider ones take PyTorch's argmax."""


def argmax(logits: torch.Tensor) -> list[int]:
    """Per row, the index of its largest logit.

    Args:
        logits: (rows, vocab), any float dtype and device. bf16 CPU rows with a contiguous
            last dimension (and under 2³¹ columns) take the C kernel; anything else
            ``torch.argmax`` in fp32.

    Returns:
        ``rows`` token ids, as torch.argmax on the fp32 values would give them.

    Raises:
        ValueError: ``logits`` is not 2-D or has no columns.
        RuntimeError: the kernel rejected the shape (it takes any 2-D shape this function
            passes it, so this means a broken build).
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax takes (rows, vocab) logits with a vocabulary, got {tuple(logits.shape)}")
    rows, n = logits.shape
    lib = q4_native._library() if logits.dtype is torch.bfloat16 and logits.device.type == "cpu" else None
    if lib is None or rows == 0 or n > _MAX_COLUMNS or logits.stride(1) != 1 or logits.stride(0) < n or \
            logits.is_neg() or logits.is_conj():  # a lazily negated view: its data are not its values
        return torch.argmax(logits.float(), dim=-1).tolist()
    out = torch.empty(rows, dtype=torch.int64)
    if lib.argmax_bf16(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr()):
        raise RuntimeError(f"argmax kernel rejected logits of shape {tuple(logits.shape)}")
    return out.tolist()
