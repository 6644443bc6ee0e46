"""Speculative end of turn: start the final transcript and the reply when the speech
pauses (``TurnConfig.early_end_ms``), before the turn surely ended (``end_silence_ms``).

Nothing of a speculation reaches the client until the session confirms it: its events
wait in a :class:`HeldOutbox` and its audio waits for :attr:`HeldOutbox.released`. If
the user goes on speaking, the session drops it (LLM request aborted, history
untouched) and the streaming transcript continues as if nothing happened. The same idea
as "eager end of turn" / speculative LLM calls in commercial voice agents; here the
transcript is decoded without committing, so a discarded speculation never changes the
words of the turn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pipeline.asr.turn import AsrTurn
from pipeline.asr.types import Partial
from pipeline.session.events import ServerEvent
from pipeline.session.replies import Reply
from pipeline.session.types import Outbox


class HeldOutbox:
    """Wraps an outbox: events are held (in order) until :meth:`release`, then flushed
    and passed straight through; audio waits for the release."""

    def __init__(self, out: Outbox) -> None:
        self.out = out
        self.released = asyncio.Event()
        self._held: list[ServerEvent] = []

    async def send(self, event: ServerEvent) -> None:
        if self.released.is_set():
            await self.out.send(event)
        else:
            self._held.append(event)

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        await self.released.wait()
        await self.out.audio(response_id, pcm16)

    async def release(self) -> None:
        """Send what was held, then let everything through."""
        while self._held:  # events held while flushing are sent in order too
            await self.out.send(self._held.pop(0))
        self.released.set()

    @property
    def held(self) -> int:
        """Events waiting for the release."""
        return len(self._held)


@dataclass(slots=True, eq=False)
class Speculation:
    """One speculative end of turn.

    Attributes:
        turn: the streaming ASR turn it decodes.
        outbox: holds the speculative reply's events and audio.
        t_end: ``time.perf_counter()`` at the end of the user's speech (s).
        task: decodes the transcript and starts the reply.
        peek: ``(partial, request, result)`` of the speculative final decode, once done.
        resp: the session's reply record, once started.
    """

    turn: AsrTurn
    outbox: HeldOutbox
    t_end: float
    task: asyncio.Task | None = None
    peek: tuple[Partial, object, object] | None = None
    resp: Reply | None = None

    def drop(self) -> None:
        """Discard it: cancel the decode and the reply (nothing was sent)."""
        if self.task is not None:
            self.task.cancel()
        if self.resp is not None:
            self.resp.cancel()
