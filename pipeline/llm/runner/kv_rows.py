"""KV tensors of batch rows for the model runner (:mod:`pipeline.llm.runner.runner`).

:class:`RowsKV` holds per-layer keys/values of shape (rows, kv_heads, T, head_dim) with a
(rows, T) attention mask, left-padded; rows are concatenated, selected, compacted and
trimmed as prompts are prefilled chunk by chunk, kept in the prefix cache, and handed to
the decoding batch (:mod:`pipeline.llm.runner.batch_kv`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RowsKV:
    """Per-layer keys/values (n, kv_heads, T, head_dim) of some rows and their mask (n, T)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    attn: torch.Tensor

    @staticmethod
    def empty() -> RowsKV:
        return RowsKV([], [], torch.zeros((1, 0), dtype=torch.long))

    @property
    def columns(self) -> int:
        return int(self.attn.shape[1])

    @staticmethod
    def cat(parts: list[RowsKV]) -> RowsKV:
        """Stack rows, left-padding each part to the longest (empty parts: all padding)."""
        t = max(p.columns for p in parts)
        attn = torch.cat([left_pad_2d(p.attn, t) for p in parts])
        ref = next((p for p in parts if p.keys), None)
        if ref is None:
            return RowsKV([], [], attn)

        def stack(i: int, vals: bool) -> torch.Tensor:
            like = (ref.values if vals else ref.keys)[i]
            buf = like.new_zeros((attn.shape[0], like.shape[1], t, like.shape[3]))
            r = 0
            for p in parts:
                if p.keys:
                    x = (p.values if vals else p.keys)[i]
                    buf[r : r + x.shape[0], :, t - x.shape[2] : t] = x
                r += p.attn.shape[0]
            return buf

        n = len(ref.keys)
        return RowsKV([stack(i, False) for i in range(n)], [stack(i, True) for i in range(n)], attn)

    def select(self, rows: list[int]) -> RowsKV:
        if len(rows) == self.attn.shape[0]:
            return self
        idx = torch.tensor(rows, device=self.attn.device)
        return RowsKV([k[idx] for k in self.keys], [v[idx] for v in self.values], self.attn[idx])

    def slice_columns(self, a: int, b: int) -> RowsKV:
        return RowsKV([k[:, :, a:b].contiguous() for k in self.keys], [v[:, :, a:b].contiguous() for v in self.values],
                   self.attn[:, a:b].contiguous())

    def trim(self) -> RowsKV:
        """Drop leading columns that are padding in every row."""
        real = torch.nonzero(self.attn.any(dim=0))
        first = int(real[0]) if len(real) else self.columns
        return self if first == 0 else self.slice_columns(first, self.columns)

    def compact(self) -> RowsKV:
        """Move each row's real columns to the right end, keeping their order."""
        if bool((self.attn[:, 1:] >= self.attn[:, :-1]).all()):
            return self  # already left-padded
        order = torch.sort(self.attn, dim=1, stable=True).indices
        idx = order[:, None, :, None]
        gather = lambda x: torch.gather(x, 2, idx.expand(-1, x.shape[1], -1, x.shape[3]))  # noqa: E731
        return RowsKV([gather(k) for k in self.keys], [gather(v) for v in self.values],
                   torch.gather(self.attn, 1, order))

    def zero_padding(self) -> RowsKV:
        """Zero K/V at padded positions: fully masked query rows can leave NaN there, and
        0 × NaN would leak into real rows' attention later."""
        if bool(self.attn.all()):
            return self
        pad = (self.attn == 0)[:, None, :, None]
        return RowsKV([k.masked_fill(pad, 0.0) for k in self.keys], [v.masked_fill(pad, 0.0) for v in self.values],
                   self.attn)


def left_pad_2d(x: torch.Tensor, t: int) -> torch.Tensor:
    if x.shape[1] == t:
        return x
    return torch.cat([torch.zeros((x.shape[0], t - x.shape[1]), dtype=x.dtype, device=x.device), x], dim=1)
