"""A request's reply as the session reads it: a coalescing output collector.

The engine thread *merges* each new piece of text into the request's pending buffer;
the asyncio consumer takes everything pending at once. A slow consumer therefore sees
fewer, longer deltas and never an unbounded queue, and the event loop is woken (one
``call_soon_threadsafe``) only when the consumer is waiting for text, not once per token.
This is vLLM v1's ``RequestOutputCollector`` (vllm/v1/engine/output_processor.py) with a
lock, because here the producer is a thread rather than a task on the same loop.
"""

from __future__ import annotations

import asyncio
import threading
import time

from pipeline.llm.types import GenStats


class TokenStream:
    """Async iterator of text deltas for one request; ends when generation ends.

    ``async for delta in stream`` yields ``str`` deltas whose concatenation is the reply;
    all text comes before the end (``StopAsyncIteration``) or the error. ``stats`` is
    complete once the iteration has ended.

    Raises:
        Exception: from ``__anext__``, the engine's exception if generation failed
            (after any text that came before it; raised once, then the stream ends).

    Attributes:
        stats: the request's :class:`GenStats`.
        submitted: ``time.perf_counter()`` at submission (s), where ``stats.ttft_ms`` starts.
        aborted: set by :meth:`abort`; the engine drops the request at its next step.

    Args:
        wake: set by :meth:`abort` so that a sleeping engine thread notices at once.
    """

    def __init__(self, wake: threading.Event | None = None) -> None:
        self.aborted = threading.Event()
        self.stats = GenStats()
        self.submitted = time.perf_counter()
        self._wake = wake
        self._lock = threading.Lock()
        self._pending: list[str] = []
        self._ended = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None

    def abort(self) -> None:
        """Stop generating at the next token step (thread-safe, idempotent)."""
        self.aborted.set()
        if self._wake is not None:
            self._wake.set()

    # ---- producer: the engine thread ---------------------------------------------------

    def put(self, delta: str) -> None:
        """Append ``delta`` to the pending text (ignored once the stream has ended)."""
        with self._lock:
            if self._ended:
                return
            self._pending.append(delta)
            waiter = self._take_waiter()
        _notify(waiter)

    def end(self, error: BaseException | None = None) -> None:
        """End the stream, with ``error`` raised to the consumer after the pending text;
        idempotent (the first call wins)."""
        with self._lock:
            if self._ended:
                return
            self._ended, self._error = True, error
            waiter = self._take_waiter()
        _notify(waiter)

    @property
    def ended(self) -> bool:
        """Whether the engine has ended the stream (text may still be pending)."""
        return self._ended

    def _take_waiter(self) -> asyncio.Future[None] | None:
        waiter, self._waiter = self._waiter, None
        return waiter

    # ---- consumer: the session's event loop --------------------------------------------

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> str:
        while True:
            with self._lock:
                if self._pending:
                    text = "".join(self._pending)
                    self._pending.clear()
                    return text
                if self._ended:
                    error, self._error = self._error, None
                    if error is not None:
                        raise error
                    raise StopAsyncIteration
                waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None


def _notify(waiter: asyncio.Future[None] | None) -> None:
    """Wake a waiting consumer on its own event loop (thread-safe)."""
    if waiter is None:
        return
    try:
        waiter.get_loop().call_soon_threadsafe(_resolve, waiter)
    except RuntimeError:  # its loop is closed: nobody is left to read
        pass


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # the consumer may have been cancelled meanwhile
        waiter.set_result(None)


def stock_stream(text: str) -> TokenStream:
    """A finished stream holding ``text`` (one delta, finish reason ``stop``, no tokens):
    what a reply speaks when no LLM may be asked (the LLM's circuit breaker is open)."""
    from pipeline.llm.types import FinishReason

    stream = TokenStream()
    stream.put(text)
    stream.stats.finish_reason = FinishReason.STOP
    stream.end()
    return stream
