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

The row KV tensors and the flat cache of a mixed step live in :mod:`pipeline.kv_rows`.

A step with both decoding rows and prompt chunks runs as ONE forward (:meth:`ModelRunner._mixed`,
vLLM-style mixed batch): every new token in one flat sequence, a block mask keeping rows
apart. On this CPU a forward costs about one pass over the weights whatever the batch, so
a separate prefill forward would cost every running request a whole extra step per join.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .kv_rows import FlatCache, RowsKV
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
        mixed: run the prefill chunks in the same forward as the decoding rows
            (:meth:`_mixed`); False runs them as a second, padded forward.
    """

    MIN_PREFIX = 8
    """Shorter shared prefixes are not worth a cache entry."""

    def __init__(self, model, device, pad_id: int, *, prefix_cache_size: int = 8, mixed: bool = True) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[_Row] = []
        self.cache = None
        self.attn: torch.Tensor | None = None  # (B, T) long
        self.pos: torch.Tensor | None = None  # (B,) long: next position id
        self.last: torch.Tensor | None = None  # (B,) long: last sampled token
        self.params: dict[int, SamplingParams] = {}
        self.prefix_cache_size = prefix_cache_size
        self.prefixes: OrderedDict[tuple[int, ...], RowsKV] = OrderedDict()
        self.prefix_hits = 0
        self._partial: dict[int, RowsKV] = {}  # rid -> KV of a prompt prefilled so far
        self.mixed = mixed

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
            if plan.decode and plan.prefill and self.mixed:
                out.update(self._mixed(plan.prefill, plan.spans))
            else:
                if plan.decode:
                    out.update(zip(ids, self._sample(self._decode(), self.rows)))
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

    def _chunks(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]):
        """Per planned chunk: its past KV (partial prompt or cached prefix), the first and
        end token to compute, and whether it starts the prompt (a prefix to remember)."""
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
        return pasts, starts, ends, fresh

    def _finish_chunks(self, reqs, ends, fresh, kv: "RowsKV", logits: torch.Tensor) -> dict[int, int]:
        """Keep unfinished prompts aside, remember new prefixes, sample and merge the rows
        whose prompt is done. ``kv`` holds every chunk's row (compacted); ``logits`` their
        last position."""
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
        toks = self._sample(logits[done].float(), rows)
        self._merge(rows, kv.select(done).trim(), torch.tensor([len(reqs[i].prompt_ids) for i in done],
                                                               device=self.device))
        return {row.rid: t for row, t in zip(rows, toks)}

    def _mixed(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]) -> dict[int, int]:
        """Decode the running rows and prefill the planned chunks in ONE forward.

        On a CPU a decode step costs about one pass over the weights whatever the batch,
        so a separate prefill forward would cost the running rows a whole step. Here all
        new tokens (one per running row, then each chunk) form one flat sequence of batch 1;
        their keys are every row's past flattened side by side, and a (1, 1, Q, L) mask lets
        each token see only its own row's past and the earlier tokens of its own chunk.
        """
        pasts, starts, ends, fresh = self._chunks(reqs, spans)
        b, t = len(self.rows), self.kv_columns
        lens = [e - s for s, e in zip(starts, ends)]
        dev = self.device
        ids = torch.cat([self.last, torch.tensor([x for r, s, e in zip(reqs, starts, ends)
                                                  for x in r.prompt_ids[s:e]], device=dev)])
        pos = torch.cat([self.pos] + [torch.arange(s, e, device=dev) for s, e in zip(starts, ends)])
        q = len(ids)
        # key columns: batch past (B*T), each chunk's past, then the Q new tokens
        seg_q = torch.cat([torch.arange(b, device=dev)] +
                          [torch.full((n,), b + j, device=dev) for j, n in enumerate(lens)])
        seg_k = torch.cat([torch.where(self.attn.bool(), torch.arange(b, device=dev)[:, None], -1).reshape(-1)] +
                          [torch.full((p.columns,), b + j, device=dev) for j, p in enumerate(pasts)] + [seg_q])
        order_k = torch.cat([torch.full((len(seg_k) - q,), -1, device=dev), torch.arange(q, device=dev)])
        mask = (seg_q[:, None] == seg_k[None, :]) & (order_k[None, :] <= torch.arange(q, device=dev)[:, None])
        cache = FlatCache([layer.keys for layer in self.cache.layers],
                           [layer.values for layer in self.cache.layers], pasts)
        last = torch.tensor([b - 1 + sum(lens[: j + 1]) for j in range(len(reqs))], device=dev)
        keep = torch.cat([torch.arange(b, device=dev), last])
        res = self.model(input_ids=ids[None], attention_mask=mask[None, None], position_ids=pos[None],
                         cache=cache, use_cache=True, logits_to_keep=keep)
        logits = res.logits[0].float()
        out = dict(zip([r.rid for r in self.rows], self._sample(logits[:b], self.rows)))
        for layer, k, v in zip(self.cache.layers, cache.new_keys, cache.new_values):  # append the decoded column
            layer.keys = torch.cat([layer.keys, k[0, :, :b].transpose(0, 1)[:, :, None]], dim=2)
            layer.values = torch.cat([layer.values, v[0, :, :b].transpose(0, 1)[:, :, None]], dim=2)
        self.attn = torch.cat([self.attn, torch.ones(b, 1, dtype=self.attn.dtype, device=dev)], dim=1)
        self.pos = self.pos + 1
        offs = [b + sum(lens[:j]) for j in range(len(reqs))]
        rows = [RowsKV([torch.cat([p.keys[i], k[:, :, o : o + n]], dim=2) if p.keys else k[:, :, o : o + n]
                     for i, k in enumerate(cache.new_keys)],
                    [torch.cat([p.values[i], v[:, :, o : o + n]], dim=2) if p.values else v[:, :, o : o + n]
                     for i, v in enumerate(cache.new_values)],
                    torch.ones((1, p.columns + n), dtype=torch.long, device=dev))
                for p, o, n in zip(pasts, offs, lens)]
        out.update(self._finish_chunks(reqs, ends, fresh, RowsKV.cat(rows), logits[b:]))
        return out

    def _prefill(self, reqs: list[SchedRequest], spans: dict[int, tuple[int, int]]) -> dict[int, int]:
        """One padded forward over every planned chunk. Row i's columns are
        [padding][its past KV][padding][its chunk]: each row sees only its own tokens."""
        from transformers import DynamicCache

        pasts, starts, ends, fresh = self._chunks(reqs, spans)
        past = RowsKV.cat(pasts)
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
        kv = RowsKV([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], attn)
        return self._finish_chunks(reqs, ends, fresh, kv.zero_padding().compact(), res.logits[:, -1])

    # ---- prefix cache ------------------------------------------------------------------

    def _cached_prefix(self, req: SchedRequest, end: int) -> tuple[RowsKV, int]:
        """(past KV, first token to compute) for a request's first chunk."""
        n = req.prefix_len
        if n >= self.MIN_PREFIX and n < end and self.prefix_cache_size:
            hit = self.prefixes.get(tuple(req.prompt_ids[:n]))
            if hit is not None:
                self.prefixes.move_to_end(tuple(req.prompt_ids[:n]))
                self.prefix_hits += 1
                return hit, n
        return RowsKV.empty(), 0

    def _remember_prefix(self, req: SchedRequest, row: RowsKV) -> None:
        n = req.prefix_len
        key = tuple(req.prompt_ids[:n])
        if n < self.MIN_PREFIX or not self.prefix_cache_size or row.columns < n or key in self.prefixes:
            return
        t = row.columns - int(row.attn.sum())  # leading padding of this compacted row
        self.prefixes[key] = row.slice_columns(t, t + n)
        while len(self.prefixes) > self.prefix_cache_size:
            self.prefixes.popitem(last=False)

    # ---- batch bookkeeping -------------------------------------------------------------

    def _merge(self, rows: list[_Row], new: RowsKV, pos: torch.Tensor) -> None:
        from transformers import DynamicCache

        if self.rows:
            old = RowsKV([layer.keys for layer in self.cache.layers], [layer.values for layer in self.cache.layers],
                      self.attn)
            new = RowsKV.cat([old, new])
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


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        sorted_p = sorted_p * ((torch.cumsum(sorted_p, 0) - sorted_p) < p.top_p)
        return int(idx[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))
