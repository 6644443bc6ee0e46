"""The decoding batch's KV cache: fixed slots in preallocated buffers (persistent batch).

Each layer's keys and values live in a buffer of shape (slot capacity, kv_heads, column
capacity, head_dim); slot i is one request's row, left-padded, and every row ends at the
same column. The model sees views ``[:slots, :, s:t]`` (:class:`BatchLayer`), so:

* a decode step writes its one new column in place (transformers' ``DynamicLayer``
  concatenates, copying the whole cache every step);
* a joining request is written into a free slot (only its own row is copied);
* a leaving request just frees its slot: nothing is copied, and leading columns that
  no live row uses are dropped by moving ``s`` (a view, not a copy).

The first version rebuilt the batch tensors on every join and leave, which cost a large part
of a step per join or leave (docs/BENCHMARKS.md).
Free slots keep decoding garbage (seen by nobody but themselves, always finite) until a
joining request takes them; when at most half the slots are live the batch is compacted.
This is the "persistent batch" of vLLM v1's GPU model runner (vllm/v1/worker/gpu_input_batch.py).
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from pipeline.llm.runner.kv_rows import RowsKV


class BatchLayer(DynamicLayer):
    """One layer of :class:`BatchKV` as a transformers cache layer: ``keys``/``values`` are
    views of the batch buffers; ``update`` writes the step's new columns in place."""

    def __init__(self, batch: BatchKV, idx: int) -> None:
        super().__init__()
        # a weak reference: batch → cache → layer → batch would be a cycle, and a dropped
        # batch's KV buffers would then stay in memory until Python's cyclic GC ran
        self._batch, self.idx, self.is_initialized = weakref.ref(batch), idx, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write (slots, kv_heads, q, head_dim) at columns [t, t+q); return the views up to t+q."""
        b = self._batch()
        if b is None:
            raise RuntimeError("the BatchKV of this cache layer is gone")
        q = key_states.shape[2]
        kb, vb = b.kb[self.idx], b.vb[self.idx]
        kb[: b.n, :, b.t : b.t + q] = key_states
        vb[: b.n, :, b.t : b.t + q] = value_states
        return kb[: b.n, :, b.s : b.t + q], vb[: b.n, :, b.s : b.t + q]


class BatchKV:
    """Slots of decoding rows over preallocated KV buffers (see module docstring).

    Attributes:
        n: slots in use (live or free); the model runs on all of them.
        s, t: the column window [s, t) the rows use (t - s = padded length T, tokens).
        cache: a transformers ``DynamicCache`` whose layers are :class:`BatchLayer` s.
        layers: those layers.
    """

    SLACK = 64
    """Spare columns (tokens) allocated whenever the buffers grow."""

    def __init__(self, first: RowsKV, config) -> None:
        k0, v0 = first.keys[0], first.values[0]
        rows, t = first.attn.shape
        self.kb = [k0.new_zeros((rows, k0.shape[1], t + self.SLACK, k0.shape[3])) for _ in first.keys]
        self.vb = [v0.new_zeros((rows, v0.shape[1], t + self.SLACK, v0.shape[3])) for _ in first.values]
        self.attn_buf = torch.zeros((rows, t + self.SLACK), dtype=torch.long, device=first.attn.device)
        self.n, self.s, self.t = 0, 0, t
        self.layers = [BatchLayer(self, i) for i in range(len(first.keys))]
        self.cache = DynamicCache(config=config)
        self.cache.layers = [*self.layers]
        self.put(list(range(rows)), first)

    # ---- views -------------------------------------------------------------------------

    @property
    def columns(self) -> int:
        return self.t - self.s

    @property
    def capacity(self) -> tuple[int, int]:
        """(slots, columns) the buffers are allocated for (≥ ``n`` and ``t``)."""
        return int(self.kb[0].shape[0]), int(self.kb[0].shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's key and value buffers (the attention mask not counted):
        slot capacity × column capacity × the KV bytes per token."""
        return sum(x.numel() * x.element_size() for x in (*self.kb, *self.vb))

    @property
    def attn(self) -> torch.Tensor:
        """(n, T) mask of the slots' columns (1 = a real token)."""
        return self.attn_buf[: self.n, self.s : self.t]

    def _refresh(self) -> None:
        for layer, kb, vb in zip(self.layers, self.kb, self.vb):
            layer.keys, layer.values = kb[: self.n, :, self.s : self.t], vb[: self.n, :, self.s : self.t]

    # ---- a step's new column -----------------------------------------------------------

    def open_column(self) -> torch.Tensor:
        """Make room for one new column per slot before a forward; returns the (n, T+1)
        attention mask including it. Call :meth:`close_column` after the forward."""
        self._reserve(1)
        self.attn_buf[: self.n, self.t] = 1  # free slots attend to themselves: always finite
        return self.attn_buf[: self.n, self.s : self.t + 1]

    def close_column(self) -> None:
        self.t += 1
        self._refresh()

    def row(self, slot: int) -> RowsKV:
        """Slot ``slot``'s real columns (its request's KV, in order) as one row: views into
        the buffers (copy what must outlive the next step)."""
        real = torch.nonzero(self.attn_buf[slot, self.s : self.t])
        first = self.s + (int(real[0]) if len(real) else self.t - self.s)
        n = self.t - first
        return RowsKV([kb[slot : slot + 1, :, first : self.t] for kb in self.kb],
                      [vb[slot : slot + 1, :, first : self.t] for vb in self.vb],
                      torch.ones((1, n), dtype=torch.long, device=self.attn_buf.device))

    # ---- slots -------------------------------------------------------------------------

    def put(self, slots: list[int], rows: RowsKV) -> None:
        """Write ``rows`` (left-padded, (m, kv_heads, Tn, head_dim) per layer) into ``slots``
        (free slots, or ``n``, ``n+1``, … to add slots), right-aligned at column t."""
        tn = rows.columns
        if tn > self.columns:
            self._extend_left(tn - self.columns)
        top = max(slots) + 1
        if top > self.kb[0].shape[0]:
            self._grow_slots(top)
        self.n = max(self.n, top)
        idx = torch.tensor(slots, device=self.attn_buf.device)
        for kb, vb, k, v in zip(self.kb, self.vb, rows.keys, rows.values):
            kb[idx, :, self.t - tn : self.t] = k
            vb[idx, :, self.t - tn : self.t] = v
        self.attn_buf[idx, self.s : self.t] = 0
        self.attn_buf[idx, self.t - tn : self.t] = rows.attn
        self._refresh()

    def trim(self, live: list[int]) -> None:
        """Drop leading columns that no ``live`` slot uses (moves ``s``; no copy)."""
        used = torch.nonzero(self.attn_buf[live, self.s : self.t].any(dim=0))
        if len(used) and int(used[0]):
            self.s += int(used[0])
            self._refresh()

    def compact(self, live: list[int]) -> list[int]:
        """Move the ``live`` slots to the front (copying only the rows that move) and
        drop the rest. Returns the new order: new slot j holds what old slot ``order[j]`` held."""
        k = len(live)
        holes = [i for i in range(k) if i not in live]
        movers = [i for i in live if i >= k]
        order = list(range(k))
        for dst, src in zip(holes, movers):
            for kb, vb in zip(self.kb, self.vb):
                kb[dst, :, self.s : self.t] = kb[src, :, self.s : self.t]
                vb[dst, :, self.s : self.t] = vb[src, :, self.s : self.t]
            self.attn_buf[dst] = self.attn_buf[src]
            order[dst] = src
        self.n = k
        self._refresh()
        return order

    # ---- growth ------------------------------------------------------------------------

    def _realloc(self, rows: int, left: int, extra: int) -> None:
        """Copy columns [s, t) into new buffers with ``rows`` slots, ``left`` new columns
        before them and ``extra`` + SLACK after."""
        width = left + self.columns + extra + self.SLACK
        a, b = left, left + self.columns

        def move(old: torch.Tensor) -> torch.Tensor:
            new = old.new_zeros((rows, old.shape[1], width, old.shape[3]))
            new[: self.n, :, a:b] = old[: self.n, :, self.s : self.t]
            return new

        self.kb = [move(x) for x in self.kb]
        self.vb = [move(x) for x in self.vb]
        attn = self.attn_buf.new_zeros((rows, width))
        attn[: self.n, a:b] = self.attn_buf[: self.n, self.s : self.t]
        self.attn_buf, self.s, self.t = attn, a, b
        self._refresh()

    def _reserve(self, q: int) -> None:
        if self.t + q > self.kb[0].shape[2]:
            self._realloc(self.kb[0].shape[0], 0, q)

    def _extend_left(self, d: int) -> None:
        if self.s >= d:  # dropped columns are still there: reuse them (masked off for every row)
            self.attn_buf[:, self.s - d : self.s] = 0
        else:
            self._realloc(self.kb[0].shape[0], d, 0)  # the new columns are zeros, masked off
        self.s -= d

    def _grow_slots(self, rows: int) -> None:
        self._realloc(max(rows, 2 * self.kb[0].shape[0]), 0, 0)
