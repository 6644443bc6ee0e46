"""Drive one session's :class:`~pipeline.asr.stream.StreamingTranscript` against the
shared ASR engine (asyncio side; the model runs in the engine's worker thread).

At most one request per session is in flight: the next update is sent once the last one
is answered and ``min_chunk_ms`` of new audio has arrived, so a slow engine makes a
session's updates less frequent instead of piling up requests. Audio that arrived faster
than it was decoded (a burst) is caught up on with updates back to back, and the final
decode waits until all of it has been worked through: no audio of a turn is skipped.

Partial updates are best effort: ``hold()`` says how long a stream's partials may be put
off now (ms since its last update; 0: not at all). The session holds them while other
users wait for their reply's first audio (``partial_hold_max_ms``), and longer while the
server is refusing turns (``partial_hold_overload_ms``): the CPU goes to the turns whose
users are waiting, not to live transcripts. The final decode and its catch-up are never
held, and the ASR stage serves them before partials (:meth:`AsrEngine.priority`); a
final with fewer partials before it decodes more of the buffer, but no audio is lost.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np

from audio.pcm import RATE
from pipeline.asr.stream import StreamingTranscript
from pipeline.asr.types import DecodeRequest, DecodeResult, Partial
from pipeline.config import AsrConfig
from pipeline.errors import Busy

logger = logging.getLogger(__name__)

class AsrTurn:
    """Streaming ASR for one turn of one session.

    Args:
        engine: the shared :class:`~pipeline.asr.engine.AsrEngine` (anything with ``run``).
        cfg: streaming settings.
        language: ISO code or None (detect).
        on_partial: awaited with each new :class:`Partial` that has words.
        spawn: starts a task the session owns (cancelled when the session closes).
        hold: how long partial updates may wait now (ms since the last one; 0 or None:
            not held).
    """

    def __init__(self, engine, cfg: AsrConfig, *, language: str | None,
                 on_partial: Callable[[Partial], Awaitable[None]],
                 spawn: Callable[..., asyncio.Task], hold: Callable[[], float] | None = None) -> None:
        self.engine, self.on_partial, self._spawn, self._hold = engine, on_partial, spawn, hold
        self.cfg = cfg
        self.held = 0  # partial updates put off by ``hold``
        self._last_update = time.monotonic()
        self.stream = StreamingTranscript(cfg, language=language)
        self.open = True
        self.updates = 0
        self.decode_ms = 0.0  # model time of this turn's decodes (ms; a batch's time counts whole)
        self.last_decode_ms = 0.0
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()  # one decode in flight (see _decode)
        self.urgent_in_flight = False  # a final, catch-up or speculative decode awaits the engine

    def feed(self, samples: np.ndarray) -> None:
        """Add 16 kHz float32 samples; starts an update when one is due."""
        self.stream.feed(samples)
        self._kick()

    def _kick(self) -> None:
        if self.open and (self._task is None or self._task.done()) and self.stream.due() and not self._held():
            self._last_update = time.monotonic()
            self._task = self._spawn(self._update())

    def _held(self) -> bool:
        """Put this partial off: ``hold()`` allows a longer wait than this stream has had."""
        if self._hold is None:
            return False
        waited_ms = (time.monotonic() - self._last_update) * 1000
        if waited_ms < self._hold():
            self.held += 1
            return True
        return False

    async def _update(self) -> None:
        try:
            part = await self._decode(final=False)
        except Busy:
            return  # the engine is saturated: try again with more audio
        except Exception:
            logger.exception("partial transcription failed")
            return
        finally:
            self._task = None
        self.updates += 1
        if part.text and self.open:
            await self.on_partial(part)
        self._kick()  # audio is left over (it came faster than it was decoded): go on

    async def _decode(self, *, final: bool, urgent: bool = False, background: bool = False) -> Partial:
        # One request in flight per stream: a cancelled decode (the turn went on, or ended)
        # may still be unwinding when the next one starts; the lock makes the next wait
        # until the stream has forgotten the cancelled request.
        async with self._lock:
            return await self._decode_locked(final=final, urgent=urgent, background=background)

    async def _decode_locked(self, *, final: bool, urgent: bool, background: bool = False) -> Partial:
        req = self.stream.request(final=final)
        if background:
            req = dataclasses.replace(req, background=True)
        elif urgent:
            req = dataclasses.replace(req, urgent=True)
        try:
            result = await self._run(req, urgent=(req.final or req.urgent) and not background)
        except BaseException:
            self.stream.cancel()
            raise
        self.last_decode_ms = result.decode_ms
        self.decode_ms += result.decode_ms
        logger.debug("asr update: %.1f s buffer, %.0f ms, batch %d, window %.0f s, %r%s",
                     len(req.audio) / RATE, result.decode_ms, result.batch, result.window_s, result.text,
                     f" (dropped: {result.dropped})" if result.dropped else "")
        return self.stream.apply(result)

    async def _run(self, req: DecodeRequest, *, urgent: bool) -> DecodeResult:
        """``engine.run(req)``, with :attr:`urgent_in_flight` set meanwhile if ``urgent``
        (admission takes this turn's own urgent decode off the ASR queue's depth)."""
        self.urgent_in_flight = urgent
        try:
            return await self.engine.run(req)
        finally:
            self.urgent_in_flight = False

    def end_input(self, *, drop_tail: int = 0) -> None:
        """The turn's speech is over: take no more audio and drop the last ``drop_tail``
        samples (the silence that ended it)."""
        self.open = False
        self.stream.drop_tail(drop_tail)

    async def finish(self, *, background: bool = False) -> Partial:
        """Decode the rest of the buffer and commit everything (after :meth:`end_input`).
        An update still in flight is dropped: if it has not reached the model yet, the
        final decode takes its place in the next batch. ``background``: nobody waits for a
        reply (a turn admission refused): its decodes go after every other request
        (:attr:`DecodeRequest.background`).

        Raises:
            Busy: the engine queue is full.
            Exception: the decode failed.
        """
        self.open = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        while not self.stream.fits_final():  # the buffer is behind: catch up first
            reached, cut = self.stream.decoded_s, self.stream.trimmed_s
            await self._decode(final=False, urgent=True, background=background)
            # progress: the request reached further, or the buffer was cut (a full
            # 27 s window then moves on by the cut, though it reaches no further yet)
            if self.stream.decoded_s <= reached and self.stream.trimmed_s <= cut:
                logger.warning("asr: no progress catching up (%.1f s buffered)", self.stream.buffer_s)
                break
        return await self._decode(final=True, background=background)

    async def peek_final(self, *, drop_tail: int = 0) -> tuple[Partial, object, object]:
        """Speculative final transcript (the speech paused; the turn may be ending):
        decode the whole buffer but its last ``drop_tail`` samples (the silence after
        the speech, as :meth:`end_input` will drop) without committing. Partial updates stop until
        :meth:`reopen`. Returns ``(partial, request, result)``; pass the last two to
        :meth:`commit_final` if the turn does end here.

        Raises:
            ValueError: the buffer is longer than one decode window (no speculation).
            Busy, Exception: as :meth:`finish`.
        """
        self.open = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        async with self._lock:
            if not self.stream.fits_final():
                raise ValueError("buffer longer than one window")
            req = self.stream.peek_request(drop_tail=drop_tail)
            result = await self._run(req, urgent=True)
        logger.debug("asr peek: %.1f s buffer, prefix %r, %.0f ms, %r", len(req.audio) / RATE, req.prefix,
                     result.decode_ms, result.text)
        self.last_decode_ms = result.decode_ms
        self.decode_ms += result.decode_ms
        return self.stream.preview(result), req, result

    @property
    def decoding(self) -> bool:
        """A decode is in flight (or unwinding): :meth:`commit_final` must not be used."""
        return self._lock.locked() or self.stream.in_flight

    def commit_final(self, req, result) -> Partial:
        """The turn ended right where :meth:`peek_final` decoded it: its result is final."""
        self.open = False
        return self.stream.commit_final(req, result)

    def committed(self) -> Partial:
        """The words committed so far (LocalAgreement: what two decodes agreed on; no
        unstable tail), without decoding anything."""
        now = self.stream.partial()
        return Partial(now.committed, "", now.committed, False, now.language)

    def reopen(self) -> None:
        """Speech resumed: continue this turn (its committed words stay)."""
        self.open = True

    def close(self) -> None:
        """Stop: cancel the update in flight."""
        self.open = False
        if self._task is not None:
            self._task.cancel()
