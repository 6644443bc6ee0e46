"""The decoding batch's slot KV (pipeline.llm.runner.batch_kv) and the packed bf16 linears
(pipeline.llm.runner.cpu_linear).

BatchKV is pure tensor bookkeeping, tested here with random tensors: after any sequence of
joins, steps, leaves, trims and compactions every live slot must still see exactly its own
tokens, in order. (Token identity with a real forward is tested in test_batching.py.)
"""

from __future__ import annotations

import gc
import weakref

import torch
from transformers import LlamaConfig

from pipeline.llm.runner.batch_kv import BatchKV
from pipeline.llm.runner.cpu_linear import PackedLinear, pack_linears, packing_supported
from pipeline.llm.runner.kv_rows import RowsKV

LAYERS, HEADS, DIM = 2, 2, 4
CONFIG = LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                     hidden_size=HEADS * DIM)


def row(n: int, seed: int) -> RowsKV:
    g = torch.Generator().manual_seed(seed)
    return RowsKV([torch.randn(1, HEADS, n, DIM, generator=g) for _ in range(LAYERS)],
                  [torch.randn(1, HEADS, n, DIM, generator=g) for _ in range(LAYERS)],
                  torch.ones(1, n, dtype=torch.long))


def seen(b: BatchKV, slot: int, layer: int = 0) -> torch.Tensor:
    """The keys a slot attends to: its real columns, in order (kv_heads, n, head_dim)."""
    return b.cache.layers[layer].keys[slot][:, b.attn[slot].bool()]


def step(b: BatchKV, seed: int) -> list[torch.Tensor]:
    """One decode step: a new column for every slot, as the model's layers write it."""
    g = torch.Generator().manual_seed(seed)
    b.open_column()
    cols = []
    for layer in b.cache.layers:
        k = torch.randn(b.n, HEADS, 1, DIM, generator=g)
        layer.update(k, k.clone())
        cols.append(k)
    b.close_column()
    return cols


def test_slots_keep_their_own_tokens_through_joins_leaves_and_growth():
    a, c = row(3, 1), row(5, 2)
    b = BatchKV(RowsKV.cat([a, c]), CONFIG)
    assert b.n == 2 and b.columns == 5
    want = {0: a.keys[0][0], 1: c.keys[0][0]}
    for i in range(70):  # past the SLACK spare columns: the buffers must grow
        cols = step(b, 100 + i)
        for s in want:
            want[s] = torch.cat([want[s], cols[0][s]], dim=1)
    for s in want:
        assert torch.equal(seen(b, s), want[s])
    assert b.columns == 75

    # slot 0 leaves; a longer prompt (80 columns > 75) takes its slot: columns extend left
    b.trim([1])
    long = row(80, 3)
    b.put([0], long)
    want[0] = long.keys[0][0]
    assert b.columns == 80 and b.n == 2
    cols = step(b, 7)
    for s in want:
        want[s] = torch.cat([want[s], cols[0][s]], dim=1)
        assert torch.equal(seen(b, s), want[s])

    # two more join (new slots 2 and 3), then 0 and 1 leave: compaction moves 2, 3 down
    d, e = row(4, 4), row(6, 5)
    b.put([2, 3], RowsKV.cat([d, e]))
    want[2], want[3] = d.keys[0][0], e.keys[0][0]
    order = b.compact([2, 3])
    assert order == [2, 3] and b.n == 2
    b.trim([0, 1])
    assert b.columns == 6  # padding no live row uses is gone
    for new, old in enumerate(order):
        assert torch.equal(seen(b, new), want[old])
        assert torch.equal(seen(b, new, layer=1), {2: d, 3: e}[old].keys[1][0])


def test_free_slots_stay_finite():
    """A free slot keeps decoding garbage; it must never turn NaN (0 × NaN in a later
    row's masked attention would poison it)."""
    b = BatchKV(RowsKV.cat([row(3, 1), row(3, 2)]), CONFIG)
    b.attn_buf[0] = 0  # slot 0 freed with nothing of its own left in view
    mask = b.open_column()
    assert bool(mask[0].any()), "every slot must see at least its own new column"


def test_packed_linear_matches_the_plain_layer():
    lin = torch.nn.Linear(64, 96, bias=True).to(torch.bfloat16)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), torch.nn.Linear(96, 8).to(torch.bfloat16))
    x = torch.randn(2, 5, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        ref = model(x)
        n = pack_linears(model)
        out = model(x)
    if not packing_supported():
        assert n == 0 and torch.equal(out, ref)  # no oneDNN bf16 here: left alone
        return
    assert n == 2 and isinstance(model[0], PackedLinear)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), atol=0.05, rtol=0.02)


def test_pack_leaves_fp32_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    assert pack_linears(model) == 0 and type(model[0]) is torch.nn.Linear


def test_a_dropped_batch_frees_its_kv_at_once():
    """No reference cycle keeps a dropped batch's buffers alive until the cyclic GC runs
    (it did: 200 requests grew RSS by ~450 MB between collections)."""
    gc.disable()
    try:
        b = BatchKV(RowsKV.cat([row(3, 1)]), CONFIG)
        step(b, 1)
        buf = weakref.ref(b.kb[0])
        del b
        assert buf() is None
    finally:
        gc.enable()
