"""Automatic prefix caching by token blocks, as vLLM's APC (docs: "Automatic Prefix Caching";
vllm/v1/core/kv_cache_utils.py ``hash_block_tokens``, vllm/v1/core/block_pool.py).

A sequence's KV is cut into blocks of ``block_size`` tokens. Block i of a sequence is known by
the hash of (block i−1's hash, its own tokens): a chain, so equal hashes mean equal
*prefixes*, not only equal blocks (the key also keeps the tokens and the parent's hash, so
a hash collision is never a false hit). A new request walks its prompt block by block and
takes the longest chain already cached: it prefills only the tokens after it. The engine
caches every prompt once prefilled and every finished request's prompt + output, so a
conversation's next turn finds its system prompt, history and the last reply as spoken.

Blocks a running request took from the cache are *referenced* (``refs``) until it leaves
the batch; unreferenced blocks are kept in LRU order and evicted first — when the KV budget
needs room for the batch (:meth:`fit`), by the out-of-memory ladder's first step
(:meth:`clear`), and when the session that made them ends (:meth:`release_owner`). A block
that is evicted leaves its descendants unreachable (a chain is walked from its root); they
are older in LRU order (a hit touches the leaf first and the root last), so leaves go first.

Unlike vLLM's paged KV cache, a block holds its own copy of the KV (per layer
``(1, kv_heads, block_size, head_dim)``): the decoding batch keeps each request's KV
contiguous (:class:`~pipeline.llm.runner.batch_kv.BatchKV`) and a hit is copied into it. The
budget counts both (:meth:`tokens`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pipeline.llm.runner.kv_rows import RowsKV

BLOCK_SIZE = 16
"""Tokens per block (vLLM's default block size)."""


@dataclass(slots=True, eq=False)
class Block:
    """One cached block: its chain hash, parent's hash, tokens, KV and references."""

    key: int
    parent: int | None
    tokens: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    refs: int = 0
    owners: set[str] = field(default_factory=set)
    orphaned: bool = False  # its last owner ended while a request used it: evicted once released


@dataclass(slots=True)
class CacheStats:
    """Counters since start: prompt tokens looked up and found, blocks evicted."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Hit tokens ÷ queried tokens (0 before any lookup)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _chain(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockCache:
    """The prefix cache (see the module docstring). Not thread-safe: the engine thread owns it.

    Args:
        block_size: tokens per block.
    """

    def __init__(self, block_size: int = BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.blocks: dict[int, Block] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced blocks, least recent first
        self._ended: OrderedDict[str, None] = OrderedDict()  # owners that ended (the last 4096)
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self.blocks)

    @property
    def tokens(self) -> int:
        """Tokens of KV the cache holds (every block, referenced or not)."""
        return len(self.blocks) * self.block_size

    @property
    def evictable_tokens(self) -> int:
        """Tokens of unreferenced blocks."""
        return len(self._lru) * self.block_size

    def _walk(self, ids: Sequence[int], limit: int) -> list[Block]:
        out: list[Block] = []
        parent: int | None = None
        b = self.block_size
        for start in range(0, limit - limit % b, b):
            tokens = tuple(ids[start : start + b])
            block = self.blocks.get(_chain(parent, tokens))
            if block is None or block.tokens != tokens or block.parent != parent:
                break
            out.append(block)
            parent = block.key
        return out

    def match(self, ids: Sequence[int], limit: int) -> list[Block]:
        """The longest cached chain of full blocks within ``ids[:limit]``, referenced (give
        them back with :meth:`release`); counts the lookup in :attr:`stats`."""
        blocks = self._walk(ids, max(0, min(limit, len(ids))))
        self.stats.queried_tokens += len(ids)
        self.stats.hit_tokens += len(blocks) * self.block_size
        for block in reversed(blocks):  # the leaf first: the root ends most recent
            if block.refs == 0:
                self._lru.pop(block.key, None)
            block.refs += 1
        return blocks

    def release(self, blocks: list[Block]) -> None:
        """A request is done with ``blocks``: unreferenced ones become evictable (most recent)."""
        for block in reversed(blocks):
            block.refs -= 1
            if block.refs == 0 and block.key in self.blocks:
                if block.orphaned and not block.owners:
                    del self.blocks[block.key]
                    self.stats.evictions += 1
                else:
                    self._lru[block.key] = None

    @staticmethod
    def gather(blocks: list[Block]) -> RowsKV:
        """The blocks' KV as one row (columns in order, no padding)."""
        if not blocks:
            return RowsKV.empty()
        layers = len(blocks[0].keys)
        keys = [torch.cat([b.keys[i] for b in blocks], dim=2) for i in range(layers)]
        values = [torch.cat([b.values[i] for b in blocks], dim=2) for i in range(layers)]
        n = keys[0].shape[2]
        return RowsKV(keys, values, torch.ones((1, n), dtype=torch.long, device=keys[0].device))

    def insert(self, ids: Sequence[int], kv: RowsKV, *, owner: str | None = None) -> int:
        """Cache the full blocks of ``ids`` whose KV is ``kv`` (one row whose last
        ``len(ids)`` columns are those tokens, in order). Returns the blocks added. An
        owner that already ended (:meth:`release_owner`) caches nothing."""
        if owner is not None and owner in self._ended:
            return 0
        b = self.block_size
        n = min(len(ids), kv.columns) // b * b
        first = kv.columns - min(len(ids), kv.columns)  # the row's leading padding, if any
        parent: int | None = None
        added = 0
        for start in range(0, n, b):
            tokens = tuple(ids[start : start + b])
            key = _chain(parent, tokens)
            block = self.blocks.get(key)
            if block is None:
                a = first + start
                block = Block(key, parent, tokens, [k[:, :, a : a + b].clone() for k in kv.keys],
                              [v[:, :, a : a + b].clone() for v in kv.values])
                self.blocks[key] = block
                self._lru[key] = None
                added += 1
            elif block.tokens != tokens or block.parent != parent:
                break  # a hash collision: stop rather than mix two chains
            if owner is not None:
                block.owners.add(owner)
                block.orphaned = False
            parent = key
        return added

    def fit(self, tokens: int) -> int:
        """Evict least recently used unreferenced blocks until the cache holds at most
        ``tokens``; returns the blocks evicted."""
        evicted = 0
        while self.tokens > max(0, tokens) and self._lru:
            key, _ = self._lru.popitem(last=False)
            del self.blocks[key]
            evicted += 1
        self.stats.evictions += evicted
        return evicted

    def clear(self) -> int:
        """Evict every unreferenced block (the out-of-memory ladder's first step)."""
        return self.fit(0)

    def release_owner(self, owner: str) -> int:
        """A session ended: forget it as an owner; evict the unreferenced blocks no live
        session made any more (a shared system prompt's blocks have other owners), and those
        still in use once released; its requests still leaving the batch cache nothing.
        Returns the blocks evicted now."""
        self._ended[owner] = None
        while len(self._ended) > 4096:
            self._ended.popitem(last=False)
        gone = 0
        for key, block in list(self.blocks.items()):
            if owner not in block.owners:
                continue
            block.owners.discard(owner)
            if block.owners:
                continue
            if block.refs:  # still in use: it goes when released
                block.orphaned = True
                continue
            self._lru.pop(key, None)
            del self.blocks[key]
            gone += 1
        self.stats.evictions += gone
        return gone
