"""voxpipe's decode attention kernel (pipeline/llm/runner/native/decode_attn.c via attn.py):
equal to fp32 SDPA for the models' head shapes and the batch KV's strided layout, the same
bits for a row whatever shares its step and however many threads run, stable for huge
scores and long contexts, and None (the PyTorch path) for what it does not take."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.llm.runner import native
from pipeline.llm.runner.mixed_attention import decode_attention
from pipeline.llm.runner.native import attn


def _sdpa(q, k, v, starts, scale):
    """fp32 reference, row by row over its own columns: (B, 1, H, D)."""
    outs = []
    for i, s in enumerate(starts):
        o = torch.nn.functional.scaled_dot_product_attention(q[i:i + 1].float(), k[i:i + 1, :, s:].float(),
                                                             v[i:i + 1, :, s:].float(), scale=scale, enable_gqa=True)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs)


def _batch_kv(b, kv, t, d, spare, gen):
    """Keys and values as the runner holds them: views into (slots, kv, columns, d) buffers
    with spare slots and columns, so no stride is the contiguous one."""
    buf_k = torch.randn(b + 2, kv, t + spare, d, generator=gen).mul(2).bfloat16()
    buf_v = torch.randn(b + 2, kv, t + spare, d, generator=gen).bfloat16()
    return buf_k[1:b + 1, :, spare:], buf_v[1:b + 1, :, spare:]


@pytest.mark.native
@given(b=st.integers(1, 8), heads=st.sampled_from([(14, 2), (8, 8), (32, 8), (9, 3), (32, 2), (12, 1)]),
       d=st.sampled_from([16, 48, 64, 80, 128, 256]), t=st.integers(1, 90), spare=st.integers(0, 5),
       seed=st.integers(0, 999))
@settings(max_examples=60, deadline=None)
def test_equals_fp32_sdpa_over_each_rows_own_columns(b, heads, d, t, spare, seed):
    h, kv = heads
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, 1, d, generator=g).bfloat16()
    k, v = _batch_kv(b, kv, t, d, spare, g)
    starts = torch.randint(0, t, (b,), generator=g).tolist()
    out = attn.attend(q, k, v, starts, d ** -0.5)
    assert out is not None and out.shape == (b, 1, h, d) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.allclose(out.float(), _sdpa(q, k, v, starts, d ** -0.5), atol=2e-2, rtol=1e-2)


@pytest.mark.native
def test_a_row_gets_the_same_bits_alone_in_a_batch_and_on_any_thread_count():
    g = torch.Generator().manual_seed(3)
    b, t = 6, 300
    q = torch.randn(b, 14, 1, 64, generator=g).bfloat16()
    k, v = _batch_kv(b, 2, t, 64, 3, g)
    starts = [0, 17, 299, 150, 1, 64]
    together = attn.attend(q, k, v, starts, 0.125, threads=2)
    assert torch.equal(attn.attend(q, k, v, starts, 0.125, threads=1), together)
    for i, s in enumerate(starts):
        alone = attn.attend(q[i:i + 1], k[i:i + 1, :, s:].contiguous(), v[i:i + 1, :, s:].contiguous(), [0],
                                   0.125)
        assert torch.equal(alone, together[i:i + 1]), i


@pytest.mark.native
def test_huge_scores_and_a_long_context_stay_finite_and_exact():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 1, 64, generator=g).mul(40).bfloat16()
    k, v = _batch_kv(2, 2, 4000, 64, 0, g)
    out = attn.attend(q, k, v, [0, 3999], 1.0)  # scores in the thousands: the softmax is one-hot
    assert out is not None and torch.isfinite(out.float()).all()
    assert torch.allclose(out.float(), _sdpa(q, k, v, [0, 3999], 1.0), atol=2e-2, rtol=1e-2)
    assert torch.equal(out[1, 0], v[1, :, 3999].repeat_interleave(2, 0))  # a single column: its value row


@pytest.mark.native
@given(heads=st.sampled_from([(14, 2), (8, 8), (9, 3)]), d=st.sampled_from([16, 48, 64, 128]), past=st.integers(0, 60),
       n=st.integers(1, 24), seed=st.integers(0, 999))
@settings(max_examples=40, deadline=None)
def test_a_prompt_chunk_equals_fp32_causal_sdpa_over_its_past_and_itself(heads, d, past, n, seed):
    h, kv = heads
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(1, n + 3, h, d, generator=g).bfloat16().transpose(1, 2)  # a mixed step's query layout
    q = flat[:, :, 3:]
    k = torch.randn(1, kv, past + n, d, generator=g).mul(2).bfloat16()
    v = torch.randn(1, kv, past + n, d, generator=g).bfloat16()
    out = attn.chunk(q, k, v, d ** -0.5)
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)  # token i sees columns 0 .. past + i
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask,
                                                           scale=d ** -0.5, enable_gqa=True).transpose(1, 2)
    assert out is not None and out.shape == (1, n, h, d) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=1e-2)
    # token i is a row over its own columns: alone (as a one-token chunk over its prefix) it gets the same bits
    i = n // 2
    alone = attn.chunk(q[:, :, i:i + 1], k[:, :, :past + i + 1], v[:, :, :past + i + 1], d ** -0.5)
    assert alone is not None and torch.equal(alone[0, 0], out[0, i])


@pytest.mark.native
def test_ends_out_of_range_are_left_to_pytorch():
    q = torch.randn(2, 4, 1, 64).bfloat16()
    k = v = torch.randn(2, 2, 10, 64).bfloat16()
    assert attn.attend(q, k, v, [0, 0], 0.1, ends=[10, 5]) is not None
    assert attn.attend(q, k, v, [0, 0], 0.1, ends=[11, 5]) is None  # past the columns
    assert attn.attend(q, k, v, [3, 0], 0.1, ends=[3, 5]) is None  # empty span
    assert attn.attend(q, k, v, [0, 0], 0.1, ends=[5]) is None  # one end for two rows
    assert attn.chunk(q[:1].transpose(1, 2), k[:1, :, :1], v[:1, :, :1], 0.1) is None  # more tokens than columns


def test_what_it_does_not_take_is_left_to_pytorch():
    q = torch.randn(1, 4, 1, 64).bfloat16()
    k = v = torch.randn(1, 2, 10, 64).bfloat16()
    assert attn.attend(q.float(), k.float(), v.float(), [0], 0.1) is None  # fp32
    assert attn.attend(q[..., :8], k[..., :8], v[..., :8], [0], 0.1) is None  # D not a multiple of 16
    assert attn.attend(q, k, v, [10], 0.1) is None  # start beyond the columns
    assert attn.attend(q, k, v, [-1], 0.1) is None
    assert attn.attend(q, k.transpose(-1, -2).contiguous().transpose(-1, -2), v, [0], 0.1) is None
    assert attn.attend(torch.randn(1, 3, 1, 64).bfloat16(), k, v, [0], 0.1) is None  # 3 heads over 2
    # shapes that do not fit one another: never read past a tensor (a key narrower than the query)
    small = torch.randn(1, 1, 3, 16).bfloat16()
    assert attn.attend(torch.randn(1, 1, 1, 256).bfloat16(), small, small, [0], 1.0) is None
    assert attn.attend(q, k, v[:, :, :5], [0], 0.1) is None
    assert attn.attend(q, k.to("meta"), v.to("meta"), [0], 0.1) is None  # not on the CPU
    assert attn.attend(torch.randn(1, 512, 1, 16).bfloat16(), small, small, [0], 1.0) is None  # 512 per KV
    assert attn.attend(q[:0], k[:0], v[:0], [], 0.1) is None  # empty batch
    assert attn.attend(q, k[:, :0], v[:, :0], [0], 0.1) is None  # no KV heads


def test_decode_attention_still_raises_or_answers_where_the_kernel_declines():
    q = torch.randn(0, 4, 1, 64).bfloat16()
    kv = torch.randn(0, 2, 10, 64).bfloat16()
    out = decode_attention(q, kv, kv, None, 0.1)
    assert out is not None and out.shape == (0, 1, 4, 64)
    with pytest.raises(RuntimeError):  # the PyTorch path's shape error, not a read past the key
        decode_attention(torch.randn(1, 1, 1, 256).bfloat16(), torch.randn(1, 1, 3, 16).bfloat16(),
                         torch.randn(1, 1, 3, 16).bfloat16(), None, 1.0)


def test_without_the_kernel_decode_attention_runs_in_pytorch(monkeypatch):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 14, 1, 64, generator=g).bfloat16()
    k, v = _batch_kv(3, 2, 50, 64, 2, g)
    starts = [0, 10, 49]
    mask = (torch.arange(50)[None] >= torch.tensor(starts)[:, None])[:, None, None, :]
    monkeypatch.setattr(native, "library", lambda: None)
    out = decode_attention(q, k, v, mask, 0.125)
    assert out is not None and torch.allclose(out.float(), _sdpa(q, k, v, starts, 0.125), atol=2e-2, rtol=1e-2)
