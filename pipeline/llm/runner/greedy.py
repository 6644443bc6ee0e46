"""Greedy decoding's argmax: voxpipe's C kernel (:mod:`~pipeline.llm.runner.native.argmax`) on
bf16 CPU logits, else PyTorch's."""

from __future__ import annotations

import torch

from pipeline.llm.runner.native import argmax as native_argmax


def argmax(logits: torch.Tensor) -> list[int]:
    """Per row, the index of its largest logit.

    Args:
        logits: (rows, vocab), any float dtype and device. bf16 CPU rows with a contiguous
            last dimension (and under 2³¹ columns) take the C kernel where it is available;
            anything else ``torch.argmax`` in fp32.

    Returns:
        ``rows`` token ids, as torch.argmax on the fp32 values would give them.

    Raises:
        ValueError: ``logits`` is not 2-D or has no columns.
        RuntimeError: the kernel rejected the shape (it takes any 2-D shape passed to it, so
            this means a broken build).
    """
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax takes (rows, vocab) logits with a vocabulary, got {tuple(logits.shape)}")
    out = native_argmax.argmax(logits)
    return torch.argmax(logits.float(), dim=-1).tolist() if out is None else out
