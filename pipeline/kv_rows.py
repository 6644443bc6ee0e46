"""KV tensors of batch rows for the model runner (:mod:`pipeline.runner`).

:class:`RowsKV` holds per-layer keys/values of shape (rows, kv_heads, T, head_dim) with a
(rows, T) attention mask, left-padded; rows are concatenated, selected, compacted and
trimmed as requests join and leave. :class:`FlatCache` is the transformers cache used
for one mixed decode + prefill forward (all new tokens in one flat sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class FlatCache:
    """Cache for :meth:`ModelRunner._mixed`: each layer's keys are the batch rows' KV laid
    side by side (B*T columns), the chunks' pasts, then the step's new tokens, which are
    also kept (``new_keys``/``new_values``) to be put back into the rows afterwards."""

    is_compileable = False

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], pasts: list["RowsKV"]) -> None:
        self.keys, self.values, self.pasts = keys, values, pasts
        self.new_keys: list[torch.Tensor] = []
        self.new_values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.new_keys.append(k)
        self.new_values.append(v)
        return self._flat(self.keys[layer_idx], [p.keys[layer_idx] for p in self.pasts if p.keys], k), \
            self._flat(self.values[layer_idx], [p.values[layer_idx] for p in self.pasts if p.values], v)

    @staticmethod
    def _flat(batch: torch.Tensor, pasts: list[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
        b, h, t, d = batch.shape
        return torch.cat([batch.transpose(0, 1).reshape(1, h, b * t, d), *pasts, new], dim=2)


@dataclass(slots=True)
class RowsKV:
    """Per-layer keys/values (n, kv_heads, T, head_dim) of some rows and their mask (n, T)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    attn: torch.Tensor

    @staticmethod
    def empty() -> "RowsKV":
        return RowsKV([], [], torch.zeros((1, 0), dtype=torch.long))

    @property
    def columns(self) -> int:
        return int(self.attn.shape[1])

    @staticmethod
    def cat(parts: list["RowsKV"]) -> "RowsKV":
        """Stack rows, left-padding each part to the longest (empty parts: all padding)."""
        t = max(p.columns for p in parts)
        attn = torch.cat([left_pad_2d(p.attn, t) for p in parts])
        ref = next((p for p in parts if p.keys), None)
        if ref is None:
            return RowsKV([], [], attn)

        def col(p: RowsKV, i: int, vals: bool) -> torch.Tensor:
            x = (p.values if vals else p.keys)[i] if p.keys else (ref.values if vals else ref.keys)[i][:1, :, :0]
            return left_pad(x, t)

        n = len(ref.keys)
        return RowsKV([torch.cat([col(p, i, False) for p in parts]) for i in range(n)],
                   [torch.cat([col(p, i, True) for p in parts]) for i in range(n)], attn)

    def select(self, rows: list[int]) -> "RowsKV":
        if len(rows) == self.attn.shape[0]:
            return self
        idx = torch.tensor(rows, device=self.attn.device)
        return RowsKV([k[idx] for k in self.keys], [v[idx] for v in self.values], self.attn[idx])

    def slice_columns(self, a: int, b: int) -> "RowsKV":
        return RowsKV([k[:, :, a:b].contiguous() for k in self.keys], [v[:, :, a:b].contiguous() for v in self.values],
                   self.attn[:, a:b].contiguous())

    def trim(self) -> "RowsKV":
        """Drop leading columns that are padding in every row."""
        real = torch.nonzero(self.attn.any(dim=0))
        first = int(real[0]) if len(real) else self.columns
        return self if first == 0 else self.slice_columns(first, self.columns)

    def compact(self) -> "RowsKV":
        """Move each row's real columns to the right end, keeping their order."""
        if bool((self.attn[:, 1:] >= self.attn[:, :-1]).all()):
            return self  # already left-padded
        order = torch.sort(self.attn, dim=1, stable=True).indices
        idx = order[:, None, :, None]
        gather = lambda x: torch.gather(x, 2, idx.expand(-1, x.shape[1], -1, x.shape[3]))  # noqa: E731
        return RowsKV([gather(k) for k in self.keys], [gather(v) for v in self.values],
                   torch.gather(self.attn, 1, order))

    def zero_padding(self) -> "RowsKV":
        """Zero K/V at padded positions: fully masked query rows can leave NaN there, and
        0 × NaN would leak into real rows' attention later."""
        if bool(self.attn.all()):
            return self
        pad = (self.attn == 0)[:, None, :, None]
        return RowsKV([k.masked_fill(pad, 0.0) for k in self.keys], [v.masked_fill(pad, 0.0) for v in self.values],
                   self.attn)


def left_pad(x: torch.Tensor, t: int) -> torch.Tensor:
    """Pad (B, H, T0, D) with zeros on the left of dim 2 up to T."""
    if x.shape[2] == t:
        return x
    pad = torch.zeros((x.shape[0], x.shape[1], t - x.shape[2], x.shape[3]), dtype=x.dtype, device=x.device)
    return torch.cat([pad, x], dim=2)


def left_pad_2d(x: torch.Tensor, t: int) -> torch.Tensor:
    if x.shape[1] == t:
        return x
    return torch.cat([torch.zeros((x.shape[0], t - x.shape[1]), dtype=x.dtype, device=x.device), x], dim=1)
