"""Attention for a mixed decode + prefill step, one segment at a time.

A mixed step (:meth:`pipeline.llm.runner.runner.ModelRunner._mixed`) runs every new token of the step
(one per decoding row, then each joining prompt chunk) as ONE flat sequence of batch 1,
so the linear layers pass over the weights once. Attention must still keep the rows
apart. Laying every row's past side by side and masking (the first version) copied the
whole batch KV twice per layer and attended each token over all B×T columns: a mixed
step cost 1.8× a decode step at batch 8 on this CPU. Here :class:`MixedCache` appends the
decoding rows' new column to the batch cache in place, and :func:`mixed_attention` runs
transformers' SDPA per segment: the decoding rows as one (B, 1) query over their own
(B, T+1) KV with the padding mask, and each chunk over its own past plus itself, causal.

The model's attention implementation is set to ``"voxpipe"`` (:func:`use_mixed_attention`),
registered with transformers' ``AttentionInterface`` (and SDPA's mask function under the
same name in ``AttentionMaskInterface``); without the ``voxpipe_mixed`` keyword
argument it is plain SDPA, so every other forward is unchanged.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

NAME = "voxpipe"


class MixedCache:
    """The transformers cache of one mixed forward.

    Args:
        batch: the running rows' cache (``DynamicCache`` of :class:`~pipeline.llm.runner.batch_kv.BatchLayer`),
            which gets each layer's decoded column written in place.
        attn: (B, T+1) bool mask of the rows' columns after this step's column.
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
        self.dec_kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: rows' (B, kv_heads, T+1, D)
        self.new_keys: list[torch.Tensor] = []  # per layer: (1, kv_heads, sum(lens), head_dim)
        self.new_values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Take the step's new keys/values (1, kv_heads, Q, head_dim) for one layer."""
        b = self.b
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
        keys, values = self.dec_kv[layer]
        q_dec = query[0, :, :b].transpose(0, 1)[:, :, None]  # (B, heads, 1, D)
        out, _ = sdpa_attention_forward(module, q_dec, keys, values, self.dec_mask, **kw)
        outs = [out.reshape(1, b, *out.shape[2:])]
        o = 0
        for past, n, mask in zip(self.pasts, self.lens, self.chunk_masks):
            k, v = self.new_keys[layer][:, :, o : o + n], self.new_values[layer][:, :, o : o + n]
            if past.keys:
                k = torch.cat([past.keys[layer], k], dim=2)
                v = torch.cat([past.values[layer], v], dim=2)
            out, _ = sdpa_attention_forward(module, query[:, :, b + o : b + o + n], k, v, mask, **kw)
            outs.append(out)
            o += n
        return torch.cat(outs, dim=1)


def mixed_attention(module, query, key, value, attention_mask, *, voxpipe_mixed: MixedCache | None = None,
                    **kwargs):
    """transformers attention function ``"voxpipe"``: per-segment attention in a mixed
    step (``voxpipe_mixed`` given), else ``sdpa_attention_forward`` unchanged."""
    if voxpipe_mixed is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
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
