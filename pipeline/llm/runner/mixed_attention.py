"""Attention for a mixed decode + prefill step, one segment at a time.

A mixed step (:meth:`pipeline.llm.runner.runner.ModelRunner._mixed`) runs every new token of the step
(one per decoding row, then each joining prompt chunk) as ONE flat sequence of batch 1,
so the linear layers pass over the weights once. Attention must still keep the rows
apart. Laying every row's past side by side and masking (the first version) copied the
whole batch KV twice per layer and attended each token over all B×T columns, so a mixed
step cost far more than a decode step. Here :class:`MixedCache` appends the
decoding rows' new column to the batch cache in place, and :func:`mixed_attention` runs
transformers' SDPA per segment: the decoding rows as one (B, 1) query over their own
(B, T+1) KV with the padding mask, and each chunk over its own past plus itself, causal.

The model's attention implementation is set to ``"voxpipe"`` (:func:`use_mixed_attention`),
registered with transformers' ``AttentionInterface`` (and SDPA's mask function under the
same name in ``AttentionMaskInterface``); without the ``voxpipe_mixed`` keyword
argument it is plain SDPA, so every other forward is unchanged.
"""

from __future__ import annotations

import threading

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from pipeline.llm.runner.native import attn as native_attn

NAME = "voxpipe"


class MixedCache:
    """The transformers cache of one mixed forward.

    Args:
        batch: the running rows' cache (``DynamicCache`` of :class:`~pipeline.llm.runner.batch_kv.BatchLayer`),
            which gets each layer's decoded column written in place; None when no row is
            decoding (a step of prompt chunks only).
        attn: (B, T+1) bool mask of the rows' columns after this step's column (B = 0: no row).
        pasts: per chunk, a :class:`~pipeline.llm.runner.kv_rows.RowsKV` with its past KV (one row,
            no padding; may be empty).
        lens: tokens of each chunk, in flat-sequence order after the B decoding tokens.
    """

    is_compileable = False

    def __init__(self, batch, attn: torch.Tensor, pasts: list, lens: list[int]) -> None:
        self.batch, self.pasts, self.lens = batch, pasts, lens
        self.b = int(attn.shape[0])
        self.dec_mask = attn.bool()[:, None, None, :]  # (B, 1, 1, T+1)
        self.chunk_masks = [self._chunk_mask(p, n, attn.device) for p, n in zip(pasts, lens)]  # same in every layer
        # a chunk whose past has no padding is plain causal attention over its KV (the C kernel)
        self.plain = [not p.keys or bool(p.attn.all()) for p in pasts]
        self.dec_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: rows' (B, kv_heads, T+1, D)
        self.new_keys: list[torch.Tensor] = []  # per layer: (1, kv_heads, sum(lens), head_dim)
        self.new_values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Take the step's new keys/values (1, kv_heads, Q, head_dim) for one layer."""
        b = self.b
        if b:
            self.dec_kv.append(self.batch.layers[layer_idx].update(k[0, :, :b].transpose(0, 1)[:, :, None],
                                                                   v[0, :, :b].transpose(0, 1)[:, :, None]))
        self.new_keys.append(k[:, :, b:])
        self.new_values.append(v[:, :, b:])
        return k, v

    @staticmethod
    def _chunk_mask(past, n: int, device) -> torch.Tensor:
        """(1, 1, n, p+n) bool: a chunk's tokens see its past's real columns and, causally, itself."""
        p = past.columns if past.keys else 0
        mask = torch.ones((n, p + n), dtype=torch.bool, device=device).tril(p)
        if p:
            mask[:, :p] &= past.attn[0].bool()
        return mask[None, None]

    def attend(self, module, query: torch.Tensor, layer: int, **kw) -> torch.Tensor:
        """Attention output (1, Q, heads, head_dim) of the flat query (1, heads, Q, head_dim)."""
        b = self.b
        outs = []
        if b:
            keys, values = self.dec_kv[layer]
            q_dec = query[0, :, :b].transpose(0, 1)[:, :, None]  # (B, heads, 1, D)
            dec = _attention(module, q_dec, keys, values, self.dec_mask, **kw)
            outs.append(dec.reshape(1, b, *dec.shape[2:]))
        o = 0
        for past, n, mask, plain in zip(self.pasts, self.lens, self.chunk_masks, self.plain):
            k, v = self.new_keys[layer][:, :, o : o + n], self.new_values[layer][:, :, o : o + n]
            if past.keys:
                k = torch.cat([past.keys[layer], k], dim=2)
                v = torch.cat([past.values[layer], v], dim=2)
            q = query[:, :, b + o : b + o + n]
            scale = kw.get("scaling")
            out = native_attn.chunk(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale) \
                if plain and not kw.get("dropout") else None
            if out is None:
                out, _ = sdpa_attention_forward(module, q, k, v, mask, **kw)
            outs.append(out)
            o += n
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float | None) -> torch.Tensor | None:
    """Exact attention of one query token per row: per row, two fp32 matmuls and a softmax
    over the row's unmasked columns.

    PyTorch's CPU SDPA runs a flash-attention kernel built for long queries: for a decode
    step's single token it is slower than plain fp32 matmuls, the more so the longer the
    batch and the rows (docs/BENCHMARKS.md). Where every row's columns are one span (a
    decode step's padding mask) and the inputs are bf16, voxpipe's C kernel
    (:func:`native_attn.attend`) runs the whole batch in one call by the same rule;
    otherwise the rows run in PyTorch.
    Rows go one at a time over exactly their unmasked columns, not over the padded
    width: where a row's padding lies then changes no rounding, so this attention gives a
    row the same bits in a batch as alone. (A whole reply is not batch-invariant: on a CPU
    with AMX a step of more than 8 rows runs the linears' bf16 copy, and prompt chunks
    prefilled inside a mixed step round differently from a prompt prefilled alone.)

    Args:
        query: (B, H, 1, D). key, value: (B, KV, T, D), H a multiple of KV (grouped-query
            attention: query head h reads KV head h // (H/KV)).
        mask: None, or (B or 1, 1, 1, T), bool (True: attend) or additive float.
        scaling: score scale (None: 1/sqrt(D)).

    Returns:
        (B, 1, H, D) in value's dtype (transformers' attention-output layout), or None for
        shapes this does not take (the caller runs SDPA).
    """
    b, h, q_len, d = query.shape
    kv, t = key.shape[1], key.shape[2]
    if q_len != 1 or query.device.type != "cpu" or h % kv or key.shape[0] != b or \
            (mask is not None and (mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1)):
        return None
    scale = d ** -0.5 if scaling is None else scaling
    rows = None if mask is None else mask.reshape(mask.shape[0], t).expand(b, t)
    starts, whole = [0] * b, [True] * b
    if rows is not None and rows.dtype == torch.bool:
        starts, whole = _row_spans(mask, rows)  # type: ignore[arg-type]
    if (rows is None or rows.dtype == torch.bool) and all(whole):
        out = native_attn.attend(query, key, value, starts, scale)
        if out is not None:
            return out
    q = query.reshape(b, kv, h // kv, d).float()
    out = torch.empty((b, kv, h // kv, d), dtype=torch.float32)
    for i in range(b):
        if whole[i]:
            k, v = key[i, :, starts[i]:], value[i, :, starts[i]:]
        else:  # gaps (a padded prompt chunk): gather the row's columns
            cols = rows[i].nonzero().squeeze(-1)  # type: ignore[index]
            k, v = key[i].index_select(1, cols), value[i].index_select(1, cols)
        scores = torch.matmul(q[i], k.float().transpose(-1, -2)).mul_(scale)  # (KV, H/KV, T')
        if rows is not None and rows.dtype != torch.bool:
            scores.add_(rows[i].float())
        torch.matmul(torch.softmax(scores, -1), v.float(), out=out[i])
    return out.to(value.dtype).reshape(b, 1, h, d)


_spans = threading.local()


def _row_spans(mask: torch.Tensor, rows: torch.Tensor) -> tuple[list[int], list[bool]]:
    """Per row of a bool mask (B, T): its first True column, and whether every column after
    it is True. Every layer of a forward gets the same mask object, so the answer is kept
    for that object (holding it, so its identity cannot pass to a new tensor)."""
    last = getattr(_spans, "last", None)
    if last is not None and last[0] is mask:
        return last[1], last[2]
    first = rows.to(torch.int32).argmax(-1)
    starts, whole = first.tolist(), (rows.sum(-1) == rows.shape[-1] - first).tolist()
    _spans.last = (mask, starts, whole)
    return starts, whole


def _attention(module, query, key, value, mask, **kw) -> torch.Tensor:
    """:func:`decode_attention` where it applies, else transformers' SDPA; (B, Q, H, D)."""
    if not kw.get("dropout") and kw.get("softcap") is None and kw.get("sliding_window") is None:
        out = decode_attention(query, key, value, mask, kw.get("scaling"))
        if out is not None:
            return out
    return sdpa_attention_forward(module, query, key, value, mask, **kw)[0]


def mixed_attention(module, query, key, value, attention_mask, *, voxpipe_mixed: MixedCache | None = None,
                    **kwargs):
    """transformers attention function ``"voxpipe"``: per-segment attention in a mixed
    step (``voxpipe_mixed`` given), else exact attention for the shape (:func:`_attention`)."""
    if voxpipe_mixed is None:
        return _attention(module, query, key, value, attention_mask, **kwargs), None
    kw = {k: kwargs[k] for k in ("dropout", "scaling") if k in kwargs}
    return voxpipe_mixed.attend(module, query, module.layer_idx, **kw), None


def use_mixed_attention(model) -> bool:
    """Switch ``model`` to the ``"voxpipe"`` attention if it runs SDPA or eager attention
    (same results: both are exact attention). Returns whether mixed steps can use it."""
    AttentionInterface.register(NAME, mixed_attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])  # same masks as SDPA
    impl = getattr(model.config, "_attn_implementation", None)
    if impl == NAME:
        return True
    if impl not in ("sdpa", "eager", None):
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, AttributeError):
        return False
    return True
