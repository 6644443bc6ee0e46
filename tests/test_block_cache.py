"""The prefix cache's bookkeeping (pure, tiny tensors): hash chains, references, LRU
eviction of unreferenced blocks (leaves before their roots), sessions' blocks released."""

from __future__ import annotations

import torch

from pipeline.llm.runner.block_cache import BlockCache
from pipeline.llm.runner.kv_rows import RowsKV


def kv(n: int, tag: float = 0.0) -> RowsKV:
    """One row of ``n`` columns, two layers; column j holds tag + j."""
    col = (torch.arange(n, dtype=torch.float32) + tag)[None, None, :, None].expand(1, 1, n, 2).clone()
    return RowsKV([col, col + 100], [col + 200, col + 300], torch.ones((1, n), dtype=torch.long))


def test_a_chain_hits_up_to_the_first_different_block_and_gathers_its_kv_in_order():
    c = BlockCache(block_size=4)
    ids = list(range(1, 13))
    assert c.insert(ids, kv(12)) == 3 and c.tokens == 12
    blocks = c.match(ids[:8] + [99, 99, 99, 99] + ids[8:], limit=16)  # the third block differs
    assert len(blocks) == 2
    got = BlockCache.gather(blocks)
    assert got.columns == 8 and torch.equal(got.keys[0][0, 0, :, 0], torch.arange(8, dtype=torch.float32))
    assert c.match(ids, limit=7) != [] and len(c.match(ids, limit=7)) == 1  # only full blocks within the limit
    assert c.match([5] + ids[1:], limit=12) == []  # a different first block: nothing after it hits either
    assert c.stats.hit_tokens == 8 + 4 + 4 and c.stats.queried_tokens == 16 + 12 + 12 + 12


def test_equal_blocks_after_different_prefixes_are_different_entries():
    c = BlockCache(block_size=2)
    c.insert([1, 2, 3, 4], kv(4, 0.0))
    c.insert([9, 9, 3, 4], kv(4, 50.0))
    a, b = c.match([1, 2, 3, 4], limit=4), c.match([9, 9, 3, 4], limit=4)
    assert len(a) == len(b) == 2 and a[1] is not b[1]
    assert float(a[1].keys[0][0, 0, 0, 0]) == 2.0 and float(b[1].keys[0][0, 0, 0, 0]) == 52.0


def test_referenced_blocks_are_never_evicted_and_leaves_go_before_roots():
    c = BlockCache(block_size=2)
    c.insert([1, 2, 3, 4, 5, 6], kv(6))
    held = c.match([1, 2, 3, 4, 5, 6, 7], limit=6)
    c.insert([8, 8], kv(2))
    assert c.fit(0) == 1 and c.tokens == 6  # only the unreferenced [8, 8] could go
    c.release(held)
    assert c.fit(4) == 1  # the leaf [5, 6] is the least recent of the chain
    assert len(c.match([1, 2, 3, 4, 5, 6, 7], limit=6)) == 2
    assert c.stats.evictions == 2


def test_padding_before_the_row_is_skipped_and_partial_blocks_are_not_cached():
    c = BlockCache(block_size=4)
    row = kv(10)  # 3 columns of padding, then 7 tokens
    assert c.insert([1, 2, 3, 4, 5, 6, 7], row) == 1
    (block,) = c.match([1, 2, 3, 4, 5, 6, 7, 8], limit=8)
    assert float(block.keys[0][0, 0, 0, 0]) == 3.0  # the first real column


def test_a_session_that_ends_takes_its_own_blocks_but_not_shared_ones():
    c = BlockCache(block_size=2)
    c.insert([1, 2, 3, 4], kv(4), owner="a")  # [1, 2]: the shared system prompt
    c.insert([1, 2, 5, 6], kv(4), owner="b")
    c.insert([1, 2, 7, 8], kv(4), owner="c")
    held = c.match([1, 2, 7, 8, 9], limit=4)
    assert c.release_owner("c") == 0  # c's blocks are referenced by a running request
    c.release(held)  # ... and go once it is done: [7, 8] only ([1, 2] is a's and b's too)
    probe = c.match([1, 2, 7, 8, 9], limit=4)
    assert len(probe) == 1
    c.release(probe)
    assert c.release_owner("a") == 1  # [3, 4] went; [1, 2] is b's too
    a, b = c.match([1, 2, 3, 4, 9], limit=4), c.match([1, 2, 5, 6, 9], limit=4)
    assert len(a) == 1 and len(b) == 2
    assert c.clear() == 0  # all referenced
    c.release(a)
    c.release(b)
    assert c.clear() == 2 and c.tokens == 0


def test_a_session_that_ends_mid_request_leaves_nothing_behind():
    """An abrupt disconnect: the session ends while its request still uses blocks and before
    the request leaves the batch; its blocks go once released, and the leaving request
    caches nothing for a dead owner."""
    c = BlockCache(block_size=2)
    c.insert([1, 2, 3, 4], kv(4), owner="gone")
    held = c.match([1, 2, 3, 4, 5], limit=4)
    assert c.release_owner("gone") == 0  # in use
    assert c.insert([1, 2, 3, 4, 5, 6], kv(6), owner="gone") == 0  # the leaving request's KV: not cached
    c.release(held)
    assert c.tokens == 0 and c.stats.evictions == 2
