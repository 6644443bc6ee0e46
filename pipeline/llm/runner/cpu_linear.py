"""Pre-packed bf16 linear layers for CPU inference (oneDNN).

``torch.nn.functional.linear`` on bf16 CPU tensors hands oneDNN a plain row-major weight,
which oneDNN reorders into its blocked (AMX/AVX-512) layout on every call. Packing each
weight once (``torch.ops.mkldnn._reorder_linear_weight``, the same op torch.compile's
freezing pass uses, torch/_inductor/fx_passes/mkldnn_fusion.py) and calling
``torch.ops.mkldnn._linear_pointwise`` skips that reorder (the decode-step gain is in
docs/BENCHMARKS.md). fp32 and int8 models are left alone (MKL already serves them well; the
packed fp32 path was not faster).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class PackedLinear(torch.nn.Module):
    """A bf16 ``nn.Linear`` whose weight is pre-packed for oneDNN.

    Input (..., in_features) bf16 → output (..., out_features) bf16, same values as the
    original layer up to bf16 rounding of the accumulation order.
    """

    def __init__(self, lin: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), None)
        self.bias = None if lin.bias is None else lin.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def packing_supported() -> bool:
    """True when this torch build and CPU run oneDNN bf16 kernels natively."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place.

    Returns the number of layers packed (0 when unsupported or nothing is bf16 on CPU).
    A layer that fails to pack keeps its plain weight.
    """
    if not packing_supported():
        return 0
    todo = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and child.weight.dtype == torch.bfloat16
            and child.weight.device.type == "cpu"]
    n = 0
    for parent, name, child in todo:
        try:
            setattr(parent, name, PackedLinear(child))
            n += 1
        except RuntimeError as exc:  # an unusual shape oneDNN will not pack: keep it plain
            logger.warning("kept %s plain: %s", name, exc)
    return n
