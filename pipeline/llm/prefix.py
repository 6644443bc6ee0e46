"""The LLM engine's side of the runner's prefix cache
(:class:`~pipeline.llm.runner.block_cache.BlockCache`): ended sessions' blocks released,
the cache bounded by what the KV budget leaves beside the batch, its counters exported.

No torch here: the cache's blocks are the runner's; this keeps the bookkeeping around them.
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING

from pipeline import metrics

if TYPE_CHECKING:
    from pipeline.llm.memory import MemoryPlan
    from pipeline.llm.runner.runner import ModelRunner


class PrefixCacheKeeper:
    """Keeps a runner's block cache (a no-op when the runner has none: ``--no-prefix-cache``).

    Args:
        runner: the model runner whose ``blocks`` (a ``BlockCache`` or None) and
            ``cache_limit`` this keeps.
        memory: the engine's :class:`~pipeline.llm.memory.MemoryPlan` (the KV token budget).
    """

    def __init__(self, runner: ModelRunner, memory: MemoryPlan) -> None:
        self.runner, self.memory = runner, memory
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()  # sessions whose cached KV goes
        self._seen = (0, 0, 0)  # cache counters already counted in the metrics

    def end_session(self, session: str) -> None:
        """``session`` ended: its blocks (those no other session made) go at the next
        :meth:`housekeeping` (thread-safe)."""
        self._ended.put(session)

    @property
    def stats(self) -> tuple[int, int, int, int]:
        """(prompt tokens looked up, found in the cache, blocks evicted, tokens cached now)."""
        blocks = self.runner.blocks
        if blocks is None:
            return 0, 0, 0, 0
        st = blocks.stats
        return st.queried_tokens, st.hit_tokens, st.evictions, blocks.tokens

    def referenced_tokens(self) -> int:
        """Cached tokens the batch's requests started from (copies while they run: not
        evictable). Read from any thread: racy, never below 0."""
        blocks = self.runner.blocks
        return 0 if blocks is None else max(0, blocks.tokens - blocks.evictable_tokens)

    def clear(self) -> None:
        """Evict every unreferenced block (the out-of-memory ladder's first step)."""
        if self.runner.blocks is not None:
            self.runner.blocks.clear()

    def housekeeping(self, reserved: int) -> None:
        """Engine thread, each step: release ended sessions' blocks; bound the cache by what
        the KV budget leaves after ``reserved`` (the batch's reservations, tokens); count its
        hits and evictions for the Prometheus counters (``voxpipe_llm_prefix_cache_*``)."""
        blocks = self.runner.blocks
        if blocks is None:
            return
        while True:
            try:
                blocks.release_owner(self._ended.get_nowait())
            except queue.Empty:
                break
        self.runner.cache_limit = self.memory.kv_free(reserved)
        st = blocks.stats
        queried, hit, evicted = self._seen
        if (st.queried_tokens, st.hit_tokens, st.evictions) != self._seen:
            metrics.PREFIX_QUERIED.inc(st.queried_tokens - queried)
            metrics.PREFIX_HIT.inc(st.hit_tokens - hit)
            metrics.PREFIX_EVICTED.inc(st.evictions - evicted)
            self._seen = (st.queried_tokens, st.hit_tokens, st.evictions)
