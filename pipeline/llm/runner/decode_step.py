"""A lean decode step for Llama-family models (Llama, Qwen2): the same arithmetic as
transformers' forward, without its per-call machinery.

With the weights read at the memory bandwidth (voxpipe's int4 kernel), a small model's
batch-1 decode step spends much of its time in Python around the kernels
(docs/BENCHMARKS.md): ``nn.Module.__call__`` for ~340 submodules, deprecation and output-capture
wrappers, per-layer keyword plumbing, and the mask builder. This step calls each
submodule's ``forward`` directly, builds the decode mask once (the padding mask, as a
(B, 1, 1, T) bool, which is what transformers' SDPA mask is for one query token) and runs
the same functions in the same order (RMSNorm, projections, transformers' own
``apply_rotary_pos_emb``, the cache update, voxpipe's attention, the MLP), so its logits
are bit-identical to ``model(...)`` (tests/test_decode_step.py holds it to that).

A mixed step (:func:`mixed`: the decoding rows' tokens and prompt chunks as one flat
sequence, :class:`~pipeline.llm.runner.mixed_attention.MixedCache` keeping the segments
apart) runs the same layers the same way, for the same reason.

Only models it can prove that for take it (:func:`supports`): the two architectures above,
every layer full attention, voxpipe's attention implementation, and no module hooks;
anything else runs transformers' forward.
"""

from __future__ import annotations

import sys
import weakref

import torch

from pipeline.llm.runner.fused_quant import FusedQuant
from pipeline.llm.runner.mixed_attention import NAME, mixed_attention

MODEL_TYPES = ("llama", "qwen2")


def supports(model) -> bool:
    """True when :func:`decode` and :func:`mixed` compute exactly what ``model(...)`` would
    for their steps."""
    cfg = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    if cfg is None or inner is None or getattr(cfg, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", None) != NAME or getattr(cfg, "use_sliding_window", False):
        return False
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
        return False
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()):
        return False
    if getattr(model, "lm_head", None) is None or len(inner.layers) != cfg.num_hidden_layers:
        return False
    return hasattr(sys.modules[type(inner.layers[0].self_attn).__module__], "apply_rotary_pos_emb")


def decode(model, input_ids: torch.Tensor, attn: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
    """One decode step: logits (B, vocab) in the model's dtype.

    Args:
        model: a model for which :func:`supports` is True.
        input_ids: (B, 1) long, each row's last token.
        attn: (B, T) padding mask of the rows' columns including this step's (nonzero: attend).
        position_ids: (B, 1) long.
        cache: the rows' transformers cache (its ``update(k, v, layer)`` appends this
            step's column and returns the layer's whole keys and values).
    """
    h = _layers(model, input_ids, position_ids, cache, attn.bool()[:, None, None, :], None)
    return model.lm_head.forward(h[:, -1:, :])[:, -1]


def mixed(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, keep: torch.Tensor) -> torch.Tensor:
    """One mixed decode + prefill step (:meth:`~pipeline.llm.runner.runner.ModelRunner._mixed`):
    the logits (len(keep), vocab) of the flat sequence's positions ``keep``, in the model's
    dtype, bit-identical to ``model(..., logits_to_keep=keep, voxpipe_mixed=cache)``.

    Args:
        model: a model for which :func:`supports` is True.
        input_ids, position_ids: (1, L) long, the step's flat sequence (one token per
            decoding row, then each prompt chunk).
        cache: the step's :class:`~pipeline.llm.runner.mixed_attention.MixedCache` (it
            stores the new keys and values and runs attention per segment).
        keep: (n,) long positions of the flat sequence whose logits are wanted.
    """
    h = _layers(model, input_ids, position_ids, cache, None, cache)
    return model.lm_head.forward(h[:, keep, :])[0]


def _layers(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, mask: torch.Tensor | None,
            segments) -> torch.Tensor:
    """The final-normed hidden states (B, S, hidden) of ``input_ids`` (B, S): transformers'
    decoder layers, called module by module. ``mask`` (B, 1, 1, T) bool is the attention
    mask, or ``segments`` a :class:`~pipeline.llm.runner.mixed_attention.MixedCache` that
    runs attention itself (then ``mask`` is unused)."""
    inner = model.model
    rope = sys.modules[type(inner.layers[0].self_attn).__module__].apply_rotary_pos_emb
    h = inner.embed_tokens.forward(input_ids)
    cos, sin = inner.rotary_emb(h, position_ids)
    b, s = input_ids.shape
    extra = {} if segments is None else {"voxpipe_mixed": segments}
    for i, (layer, (qkv, gate_up)) in enumerate(zip(inner.layers, _fused(model))):
        a = layer.self_attn
        x = layer.input_layernorm.forward(h)
        shape = (b, s, -1, a.head_dim)
        if qkv is not None:
            q, k, v = (y.view(shape).transpose(1, 2) for y in qkv(x))
        else:
            q = a.q_proj.forward(x).view(shape).transpose(1, 2)
            k = a.k_proj.forward(x).view(shape).transpose(1, 2)
            v = a.v_proj.forward(x).view(shape).transpose(1, 2)
        q, k = rope(q, k, cos, sin)
        k, v = cache.update(k, v, i)
        o, _ = mixed_attention(a, q, k, v, mask, dropout=0.0, scaling=a.scaling,
                               sliding_window=getattr(a, "sliding_window", None), **extra)
        h = h + a.o_proj.forward(o.reshape(b, s, -1).contiguous())
        x = layer.post_attention_layernorm.forward(h)
        m = layer.mlp
        g, u = gate_up(x) if gate_up is not None else (m.gate_proj.forward(x), m.up_proj.forward(x))
        h = h + m.down_proj.forward(m.act_fn.forward(g) * u)
    return inner.norm.forward(h)


_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fused(model) -> list[tuple[FusedQuant | None, FusedQuant | None]]:
    """Per layer, its q/k/v and gate/up projections as one int4 kernel call each
    (:class:`~pipeline.llm.runner.fused_quant.FusedQuant`; None where they are not all on
    voxpipe's int4 kernel), built on a model's first decode step and kept with it."""
    plan = _FUSED.get(model)
    if plan is None:
        plan = [(FusedQuant.of([lyr.self_attn.q_proj, lyr.self_attn.k_proj, lyr.self_attn.v_proj]),
                 FusedQuant.of([lyr.mlp.gate_proj, lyr.mlp.up_proj])) for lyr in model.model.layers]
        _FUSED[model] = plan
    return plan
