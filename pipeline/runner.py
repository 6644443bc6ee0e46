"""Model runner: executes scheduler plans over one left-padded, batched KV cache.

The batch is a transformers ``DynamicCache`` whose per-layer key/value tensors have shape
(batch, kv_heads, T, head_dim), plus an attention mask (batch, T) that is 0 on padding,
each row's next position id, and each row's last sampled token. Rows join by prefilling
their prompts (left-padded among themselves) and being left-padded to a common length
with the running rows; rows leave by index selection; columns that are padding for
every row are trimmed. Each row keeps its own position ids, so a request's tokens are
the same as when it runs alone (tested token-for-token with a tiny fp32 model).
"""

from __future__ import annotations

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
    """

    def __init__(self, model, device, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, pad_id
        self.rows: list[_Row] = []
        self.cache = None
        self.attn: torch.Tensor | None = None  # (B, T) long
        self.pos: torch.Tensor | None = None  # (B,) long: next position id
        self.last: torch.Tensor | None = None  # (B,) long: last sampled token
        self.params: dict[int, SamplingParams] = {}

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

    def set_params(self, rid: int, params: SamplingParams) -> None:
        """Sampling parameters of a request before it is prefilled."""
        self.params[rid] = params

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Evict, decode the running rows one token, prefill the joining requests.

        Returns ``rid -> sampled token id`` for every decoded or prefilled request.
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
                out.update(self._prefill(plan.prefill))
            if self.rows:
                self.last = torch.tensor([out[r.rid] for r in self.rows], device=self.device)
        return out

    # ---- steps -----------------------------------------------------------------------

    def _decode(self) -> torch.Tensor:
        b = len(self.rows)
        attn = torch.cat([self.attn, torch.ones(b, 1, dtype=self.attn.dtype, device=self.device)], dim=1)
        res = self.model(input_ids=self.last[:, None], attention_mask=attn, position_ids=self.pos[:, None],
                         cache=self.cache, use_cache=True)
        self.attn, self.pos = attn, self.pos + 1
        return res.logits[:, -1].float()

    def _prefill(self, reqs: list[SchedRequest]) -> dict[int, int]:
        from transformers import DynamicCache

        lens = [len(r.prompt_ids) for r in reqs]
        length = max(lens)
        ids = torch.full((len(reqs), length), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(reqs), length), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, length - lens[i] :] = torch.tensor(r.prompt_ids)
            attn[i, length - lens[i] :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        res = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True)
        _zero_padding(cache, attn)
        rows = [_Row(r.rid, self.params.pop(r.rid, SamplingParams())) for r in reqs]
        toks = self._sample(res.logits[:, -1].float(), rows)
        self._merge(rows, cache, attn, torch.tensor(lens, device=self.device))
        return {r.rid: t for r, t in zip(reqs, toks)}

    # ---- batch bookkeeping -------------------------------------------------------------

    def _merge(self, rows: list[_Row], cache, attn: torch.Tensor, pos: torch.Tensor) -> None:
        if not self.rows:
            self.rows, self.cache, self.attn, self.pos = rows, cache, attn, pos
            return
        t = max(self.kv_columns, attn.shape[1])
        for old, new in zip(self.cache.layers, cache.layers):
            old.keys = torch.cat([_left_pad(old.keys, t), _left_pad(new.keys, t)], dim=0)
            old.values = torch.cat([_left_pad(old.values, t), _left_pad(new.values, t)], dim=0)
        self.attn = torch.cat([_left_pad_2d(self.attn, t), _left_pad_2d(attn, t)], dim=0)
        self.pos = torch.cat([self.pos, pos])
        self.rows = self.rows + rows

    def _evict(self, rids: set[int]) -> None:
        keep = [i for i, r in enumerate(self.rows) if r.rid not in rids]
        for rid in rids:
            self.params.pop(rid, None)
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


def _zero_padding(cache, attn: torch.Tensor) -> None:
    """Zero K/V at padded positions: fully masked query rows can leave NaN there, and
    0 × NaN would leak into real rows' attention later."""
    if bool(attn.all()):
        return
    pad = (attn == 0)[:, None, :, None]
    for layer in cache.layers:
        layer.keys = layer.keys.masked_fill(pad, 0.0)
        layer.values = layer.values.masked_fill(pad, 0.0)
