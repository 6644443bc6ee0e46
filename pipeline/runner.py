"""Model runner: executes scheduler plans over one left-padded, batched KV cache.

The batch is a transformers ``DynamicCache`` whose per-layer key/value tensors have shape
(batch, kv_heads, T, head_dim), plus an attention mask (batch, T) that is 0 on padding,
each row's next position id, and each row's last sampled token. Each row keeps its own
position ids, so a request's tokens are the same as when it runs alone (tested
token-for-token with a tiny fp32 model).

Prefill is chunked and batched: every prompt chunk planned for a step (several joining
requests, each resuming where its previous chunk stopped) runs in one padded forward
over the rows' own past KV. A row whose prompt is not finished keeps its KV aside
(``_partial``); a finished one samples its first token and is appended to the batch.
A request's shared prefix (``SchedRequest.prefix_len``: the system prompt, the same for
every chat request) is computed once and then copied from a small LRU prefix cache, so a
joining request prefills only its own tokens. After each forward a row's KV is compacted
(real columns to the right, in order: RoPE is already applied, so a column may move), and
columns that are padding for every row are trimmed.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .scheduler import SchedRequest, StepPlan


@dataclass(slots=True)
class SamplingParams:
    """Per-request sampling: ``temperature`` 0 = greedy; else temperature + top-p
    (nucleus, Holtzman et al. 2020) with a per-request ``seed``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(slots=True)
class _Row:
    rid: int
    params: SamplingParams
    gen: torch.Generator | None = field(default=None)


class ModelRunner:
    """Runs :class:`StepPlan` s on a causal LM; returns one sampled token per row.

    Args:
        model: a transformers causal LM (eval mode).
        device: its ``torch.device``.
        pad_id: token id used for padding (its embeddings are masked out).
        prefix_cache_size: shared prompt prefixes whose KV is kept (0 disables).
    """

    MIN_PREFIX = 8
    """Shorter shared prefixes are not worth a cache entry."""

    def __init__(self, model, device, pad_id: int, *, prefix_cache_size: int = 8) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[_Row] = []
        self.cache = None
        self.attn: torch.Tensor | None = None  # (B, T) long
        self.pos: torch.Tensor | None = None  # (B,) long: next position id
        self.last: torch.Tensor | None = None  # (B,) long: last sampled token
        self.params: dict[int, SamplingParams] = {}
        self.prefix_cache_size = prefix_cache_size
        self.prefixes: OrderedDict[tuple[int, ...], _KV] = OrderedDict()
        self.prefix_hits = 0
        self._partial: dict[int, _KV] = {}  # rid -> KV of a prompt prefilled so far

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def kv_columns(self) -> int:
        """Padded KV length T of the batch (tokens)."""
        return 0 if self.attn is None else int(self.attn.shape[1])

    def reset(self) -> None:
        """Drop every row and the KV cache (after a failed step)."""
        self.rows, self.cache, self.attn, self.pos, self.last = [], None, None, None, None
        self.params.clear()
        self._partial.clear()

    def set_params(self, rid: int, params: SamplingParams) -> None:
        """Sampling parameters of a request before it is prefilled."""
        self.params[rid] = params

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Evict, decode the running rows one token, prefill the planned prompt chunks.

        Returns ``rid -> sampled token id`` for every decoded request and every request
        whose prompt is now fully prefilled.
        """
        out: dict[int, int] = {}
        with torch.inference_mode():
            if plan.evict:
                self._evict(set(plan.evict))
            if plan.decode:
                ids = [r.rid for r in self.rows]
                if ids != [r.rid for r in plan.decode]:
                    raise RuntimeError(f"runner rows {ids} do not match the plan {[r.rid for r in plan.decode]}")
                logits = self._decode()
                out.update(zip(ids, self._sample(logits, self.rows)))
            if plan.prefill:
                out.update(self._prefill(plan.prefill, plan.spans))
            if self.rows:
                self.last = torch.tensor([out[r.rid] for r in self.rows], device=self.device)
        return out

    # ---- steps -----------------------------------------------------------------------

    def _decode(self) -> torch.Tensor:
        b = len(self.rows)
        attn = torch.cat([self.attn, torch.ones(b, 1, dtype=self.attn.dtype, device=self.device)], dim=1)
        res = self.model(input_ids=self.last[:, None], attention_mask=attn, position_ids=self.pos[:, None],
                         cache=self.cache, use_cache=True, logits_to_keep=1)
        self.attn, self.pos = attn, self.pos + 1
        return res.logits[:, -1].float()

    def _prefill(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One padded forward over every planned chunk. Row i's columns are
        [padding][its past KV][padding][its chunk]: each row sees only its own tokens."""
        from transformers import DynamicCache

        pasts, starts, ends, fresh = [], [], [], []
        for r in reqs:
            start, end = spans[r.rid]
            past = self._partial.pop(r.rid, None)
            if past is None:
                past, start = self._cached_prefix(r, end)
            fresh.append(start == 0)
            pasts.append(past)
            starts.append(start)
            ends.append(end)
        past = _KV.cat(pasts)
        n, tp = len(reqs), past.columns
        c = max(e - s for s, e in zip(starts, ends))
        ids = torch.full((n, c), self.pad_id, dtype=torch.long)
        chunk = torch.zeros((n, c), dtype=torch.long)
        pos = torch.zeros((n, c), dtype=torch.long)
        for i, (r, s, e) in enumerate(zip(reqs, starts, ends)):
            ids[i, c - (e - s) :] = torch.tensor(r.prompt_ids[s:e])
            pos[i, c - (e - s) :] = torch.arange(s, e)
            chunk[i, c - (e - s) :] = 1
        ids, pos = ids.to(self.device), pos.to(self.device)
        attn = torch.cat([past.attn, chunk.to(self.device)], dim=1)
        cache = DynamicCache(ddp_cache_data=list(zip(past.keys, past.values)) if tp else None,
                             config=self.model.config)
        res = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True,
                         logits_to_keep=1)
        kv = _KV([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], attn)
        kv = kv.zero_padding().compact()
        done = [i for i, (r, e) in enumerate(zip(reqs, ends)) if e >= len(r.prompt_ids)]
        for i, r in enumerate(reqs):
            if fresh[i] or i not in done:
                row = kv.select([i]).trim()
                if fresh[i]:
                    self._remember_prefix(r, row)
                if i not in done:
                    self._partial[r.rid] = row
        if not done:
            return {}
        rows = [_Row(reqs[i].rid, self.params.pop(reqs[i].rid, SamplingParams())) for i in done]
        toks = self._sample(res.logits[done, -1].float(), rows)
        self._merge(rows, kv.select(done).trim(), torch.tensor([len(reqs[i].prompt_ids) for i in done],
                                                               device=self.device))
        return {row.rid: t for row, t in zip(rows, toks)}

    # ---- prefix cache ------------------------------------------------------------------

    def _cached_prefix(self, req: SchedRequest, end: int) -> tuple[_KV, int]:
        """(past KV, first token to compute) for a request's first chunk."""
        n = req.prefix_len
        if n >= self.MIN_PREFIX and n < end and self.prefix_cache_size:
            hit = self.prefixes.get(tuple(req.prompt_ids[:n]))
            if hit is not None:
                self.prefixes.move_to_end(tuple(req.prompt_ids[:n]))
                self.prefix_hits += 1
                return hit, n
        return _KV.empty(), 0

    def _remember_prefix(self, req: SchedRequest, row: _KV) -> None:
        n = req.prefix_len
        key = tuple(req.prompt_ids[:n])
        if n < self.MIN_PREFIX or not self.prefix_cache_size or row.columns < n or key in self.prefixes:
            return
        t = row.columns - int(row.attn.sum())  # leading padding of this compacted row
        self.prefixes[key] = row.slice_columns(t, t + n)
        while len(self.prefixes) > self.prefix_cache_size:
            self.prefixes.popitem(last=False)

    # ---- batch bookkeeping -------------------------------------------------------------

    def _merge(self, rows: list[_Row], new: _KV, pos: torch.Tensor) -> None:
        from transformers import DynamicCache

        if self.rows:
            old = _KV([layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers],
                      self.attn)
            new = _KV.cat([old, new])
            pos = torch.cat([self.pos, pos])
        self.cache = DynamicCache(ddp_cache_data=list(zip(new.keys, new.values)), config=self.model.config)
        self.rows, self.attn, self.pos = self.rows + rows, new.attn, pos

    def _evict(self, rids: set[int]) -> None:
        for rid in rids:
            self.params.pop(rid, None)
            self._partial.pop(rid, None)
        keep = [i for i, r in enumerate(self.rows) if r.rid not in rids]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.attn, self.pos, self.last = [], None, None, None, None
            return
        idx = torch.tensor(keep, device=self.device)
        self.rows = [self.rows[i] for i in keep]
        self.attn, self.pos, self.last = self.attn[idx], self.pos[idx], self.last[idx]
        first = int(torch.nonzero(self.attn.any(dim=0))[0])  # trim all-padding columns
        self.attn = self.attn[:, first:]
        for layer in self.cache.layers:
            layer.keys = layer.keys[idx, :, first:]
            layer.values = layer.values[idx, :, first:]

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        toks = torch.argmax(logits, dim=-1).tolist()
        for i, row in enumerate(rows):
            p = row.params
            if p.temperature > 0:
                if row.gen is None:
                    row.gen = torch.Generator(device="cpu").manual_seed(p.seed)
                toks[i] = _sample_row(logits[i].cpu(), p, row.gen)
        return toks


@dataclass(slots=True)
class _KV:
    """Per-layer keys/values (n, kv_heads, T, head_dim) of some rows and their mask (n, T)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    attn: torch.Tensor

    @staticmethod
    def empty() -> "_KV":
        return _KV([], [], torch.zeros((1, 0), dtype=torch.long))

    @property
    def columns(self) -> int:
        return int(self.attn.shape[1])

    @staticmethod
    def cat(parts: list["_KV"]) -> "_KV":
        """Stack rows, left-padding each part to the longest (empty parts: all padding)."""
        t = max(p.columns for p in parts)
        attn = torch.cat([_left_pad_2d(p.attn, t) for p in parts])
        ref = next((p for p in parts if p.keys), None)
        if ref is None:
            return _KV([], [], attn)

        def col(p: _KV, i: int, vals: bool) -> torch.Tensor:
            x = (p.values if vals else p.keys)[i] if p.keys else (ref.values if vals else ref.keys)[i][:1, :, :0]
            return _left_pad(x, t)

        n = len(ref.keys)
        return _KV([torch.cat([col(p, i, False) for p in parts]) for i in range(n)],
                   [torch.cat([col(p, i, True) for p in parts]) for i in range(n)], attn)

    def select(self, rows: list[int]) -> "_KV":
        if len(rows) == self.attn.shape[0]:
            return self
        idx = torch.tensor(rows, device=self.attn.device)
        return _KV([k[idx] for k in self.keys], [v[idx] for v in self.values], self.attn[idx])

    def slice_columns(self, a: int, b: int) -> "_KV":
        return _KV([k[:, :, a:b].contiguous() for k in self.keys], [v[:, :, a:b].contiguous() for v in self.values],
                   self.attn[:, a:b].contiguous())

    def trim(self) -> "_KV":
        """Drop leading columns that are padding in every row."""
        real = torch.nonzero(self.attn.any(dim=0))
        first = int(real[0]) if len(real) else self.columns
        return self if first == 0 else self.slice_columns(first, self.columns)

    def compact(self) -> "_KV":
        """Move each row's real columns to the right end, keeping their order."""
        if bool((self.attn[:, 1:] >= self.attn[:, :-1]).all()):
            return self  # already left-padded
        order = torch.sort(self.attn, dim=1, stable=True).indices
        idx = order[:, None, :, None]
        gather = lambda x: torch.gather(x, 2, idx.expand(-1, x.shape[1], -1, x.shape[3]))  # noqa: E731
        return _KV([gather(k) for k in self.keys], [gather(v) for v in self.values],
                   torch.gather(self.attn, 1, order))

    def zero_padding(self) -> "_KV":
        """Zero K/V at padded positions: fully masked query rows can leave NaN there, and
        0 × NaN would leak into real rows' attention later."""
        if bool(self.attn.all()):
            return self
        pad = (self.attn == 0)[:, None, :, None]
        return _KV([k.masked_fill(pad, 0.0) for k in self.keys], [v.masked_fill(pad, 0.0) for v in self.values],
                   self.attn)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        sorted_p = sorted_p * ((torch.cumsum(sorted_p, 0) - sorted_p) < p.top_p)
        return int(idx[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def _left_pad(x: torch.Tensor, t: int) -> torch.Tensor:
    """Pad (B, H, T0, D) with zeros on the left of dim 2 up to T."""
    if x.shape[2] == t:
        return x
    pad = torch.zeros((x.shape[0], x.shape[1], t - x.shape[2], x.shape[3]), dtype=x.dtype, device=x.device)
    return torch.cat([pad, x], dim=2)


def _left_pad_2d(x: torch.Tensor, t: int) -> torch.Tensor:
    if x.shape[1] == t:
        return x
    return torch.cat([torch.zeros((x.shape[0], t - x.shape[1]), dtype=x.dtype, device=x.device), x], dim=1)
