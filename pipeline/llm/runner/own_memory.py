"""Move a loaded model's weights out of the weights file's memory map.

transformers hands over safetensors weights as views of a private memory map of the file.
Two costs follow on CPU:

* every page of the file the weights touch stays mapped and counted in the process's RSS
  as long as one tensor still points into it. Quantizing or packing the linear layers makes
  their own copies, but a few small norm and bias tensors keep the whole file mapped and
  resident: the process holds the weights twice;
* each embedding row is read from the file on its first lookup: a page fault (a disk read,
  on a cold cache) in the middle of a decode step, for every token not seen before.

The figures are in docs/BENCHMARKS.md ("Numbers formerly in docstrings").

:func:`own_weights` copies every tensor that still lies in a file-backed mapping into the
process's own memory, in place, so the mapping is released.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def file_ranges(maps: str | None = None) -> list[tuple[int, int]] | None:
    """Address ranges ``[start, end)`` of this process's file-backed memory maps (from
    ``/proc/self/maps`` unless ``maps`` is given; a line whose path starts with ``/``); None
    where it cannot be read (not Linux). Any file, not only those under the model's folder: a
    hub snapshot's files are symlinks, and the maps name their targets."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    ranges = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = fields[0].split("-")
            ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@dataclass(frozen=True)
class OwnReport:
    """What :func:`own_weights` copied: tensors and bytes (``maps_read`` False: the maps
    could not be read, so only the input embedding was copied)."""

    tensors: int
    bytes: int
    maps_read: bool = True


def own_weights(model: torch.nn.Module) -> OwnReport:
    """Copy every parameter, buffer and tensor attribute of ``model``'s modules that lies in a
    file-backed memory map (:func:`file_ranges`) into the process's own memory, in place.

    A ``Parameter`` keeps its identity (``.data`` is replaced), so weights tied to it stay
    tied; other tensors are replaced by their copies. Where ``/proc/self/maps`` cannot be
    read, only the input embedding is copied (the one read on the serving path by rows).
    """
    ranges = file_ranges()
    if ranges is None:
        get = getattr(model, "get_input_embeddings", None)
        emb = get() if callable(get) else None
        if not isinstance(emb, torch.nn.Module) or not isinstance(emb.weight, torch.Tensor) or \
                emb.weight.device.type != "cpu":
            return OwnReport(0, 0, maps_read=False)
        with torch.no_grad():
            emb.weight.data = emb.weight.data.clone()
        return OwnReport(1, emb.weight.numel() * emb.weight.element_size(), maps_read=False)

    def mapped(t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or t.layout is not torch.strided:
            return False
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # an opaque tensor (oneDNN's own layout)
            return False
        return any(lo <= ptr < hi for lo, hi in ranges)

    done: set[int] = set()
    n = size = 0
    with torch.no_grad():
        for m in model.modules():
            found: list[tuple[str, torch.Tensor, str]] = [(k, t, "p") for k, t in m._parameters.items()
                                                           if t is not None]
            found += [(k, t, "b") for k, t in m._buffers.items() if t is not None]
            found += [(k, t, "a") for k, t in vars(m).items() if isinstance(t, torch.Tensor)]
            for name, t, kind in found:
                if id(t) in done or not mapped(t):
                    continue
                done.add(id(t))
                n, size = n + 1, size + t.numel() * t.element_size()
                if isinstance(t, torch.nn.Parameter):
                    t.data = t.data.clone()
                elif kind == "b":
                    m._buffers[name] = t.clone()
                else:
                    setattr(m, name, t.clone())
    return OwnReport(n, size)
