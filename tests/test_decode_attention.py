"""Decode-step attention (pipeline/llm/runner/mixed_attention.py, ``decode_attention``): equal
to fp32 SDPA for grouped-query heads and every mask kind, the same bits for a row whatever
padding surrounds it, and SDPA for the shapes it does not take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.llm.runner.mixed_attention import decode_attention


def _qkv(b: int, h: int, kv: int, t: int, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, s, d, generator=g).mul(2).to(torch.bfloat16)
               for n, s in ((h, 1), (kv, t), (kv, t)))
    return q, k, v


def _sdpa(q, k, v, mask, scale):
    """The fp32 reference: (B, 1, H, D)."""
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                           scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


@given(b=st.integers(1, 5), groups=st.sampled_from([(4, 4), (8, 2), (14, 2)]), t=st.integers(1, 70),
       seed=st.integers(0, 1000), kind=st.sampled_from(["none", "bool", "gaps", "float"]))
@settings(max_examples=60, deadline=None)
def test_equals_fp32_sdpa(b, groups, t, seed, kind):
    h, kv = groups
    q, k, v = _qkv(b, h, kv, t, seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = None
    if kind in ("bool", "gaps"):
        starts = torch.randint(0, t, (b,), generator=g)
        mask = torch.arange(t)[None] >= starts[:, None]  # left padding
        if kind == "gaps":
            mask &= torch.rand(b, t, generator=g) > 0.3
            mask[:, -1] = True  # every row attends somewhere
        mask = mask[:, None, None, :]
    elif kind == "float":
        mask = torch.randn(1, 1, 1, t, generator=g)
    out = decode_attention(q, k, v, mask, 0.3)
    assert out is not None and out.shape == (b, 1, h, 16) and out.dtype == torch.bfloat16
    ref = _sdpa(q, k, v, mask, 0.3)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=1e-2)  # one bf16 rounding of the output


@given(t=st.integers(1, 40), pad=st.integers(0, 40), others=st.integers(0, 3), seed=st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_a_row_gets_the_same_bits_whatever_padding_and_rows_share_its_step(t, pad, others, seed):
    q, k, v = _qkv(1, 8, 2, t, seed=seed)
    alone = decode_attention(q, k, v, None, None)
    # the same row at the end of a batch, left-padded with garbage columns, beside other rows
    g = torch.Generator().manual_seed(seed + 1)
    b = others + 1
    qb, kb, vb = _qkv(b, 8, 2, pad + t, seed=seed + 2)
    qb[-1:], kb[-1:, :, pad:], vb[-1:, :, pad:] = q, k, v
    kb[-1:, :, :pad] = torch.randn(1, 2, pad, 16, generator=g).to(torch.bfloat16) * 50
    mask = torch.ones(b, 1, 1, pad + t, dtype=torch.bool)
    mask[-1, ..., :pad] = False
    together = decode_attention(qb, kb, vb, mask, None)
    assert together is not None and torch.equal(together[-1:], alone)


def test_shapes_it_does_not_take_go_back_to_sdpa():
    q, k, v = _qkv(2, 4, 2, 10)
    assert decode_attention(torch.cat([q, q], 2), k, v, None, None) is None  # two query tokens
    assert decode_attention(q, k, v, torch.ones(2, 4, 1, 10, dtype=torch.bool), None) is None  # per-head mask
    assert decode_attention(torch.randn(2, 3, 1, 16), k, v, None, None) is None  # 3 heads over 2


def test_the_model_attention_uses_it_for_decode_and_sdpa_for_prompts(monkeypatch):
    import pipeline.llm.runner.mixed_attention as ma

    calls: list[int] = []
    real = ma.decode_attention

    def counting(query, *a):
        out = real(query, *a)
        calls.append(int(out is not None))
        return out

    monkeypatch.setattr(ma, "decode_attention", counting)
    q, k, v = _qkv(1, 4, 2, 6)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    module.is_causal = True
    out, _ = ma.mixed_attention(module, q, k, v, None, scaling=0.25)
    assert calls == [1] and out.shape == (1, 1, 4, 16)
    prompt = torch.randn(1, 4, 6, 16).to(torch.bfloat16)
    out, _ = ma.mixed_attention(module, prompt, k, v, None, scaling=0.25)
    assert calls == [1, 0] and out.shape == (1, 6, 4, 16)
    with pytest.raises(ValueError, match="softcap"):
        ma.mixed_attention(module, q, k, v, None, softcap=1.0)
