"""A bounded per-connection send queue drained by one writer task.

Producers (the session's tasks) ``await`` space in the queue; the writer awaits the
socket, whose own buffer is bounded by websockets' ``write_limit``. A client that does
not read blocks only its own producers, and after ``timeout_s`` without progress the
connection is closed with code 1008 — memory stays bounded and other sessions never wait.

When ``session.started`` declared Opus reply audio, each reply's PCM16 is encoded here (one
Opus stream per reply, 20 ms packets, on the codec pool: :mod:`audio.opus`) and every packet
goes out as its own binary frame; ``response.done`` flushes the reply's last packet first.
"""

from __future__ import annotations

import asyncio
import logging

from audio.frames import audio_frame
from audio.opus import OpusEncoder, run_codec
from pipeline.session import events as ev
from pipeline.session.events import ServerEvent

from .protocol import encode_event

logger = logging.getLogger(__name__)


class SlowClient(RuntimeError):
    """The client stopped reading; its connection is being closed."""


class WsOutbox:
    """Outbox over a websockets connection.

    Args:
        ws: a ``websockets.asyncio.server.ServerConnection``.
        maxsize: frames buffered before producers wait.
        timeout_s: longest wait for space before the client is dropped as too slow.
    """

    def __init__(self, ws, *, maxsize: int, timeout_s: float) -> None:
        self.ws = ws
        self.timeout_s = timeout_s
        self._q: asyncio.Queue[str | bytes | None] = asyncio.Queue(maxsize=maxsize)
        self.closed = False
        self._closer: asyncio.Future | None = None  # closes a slow client's socket
        self._opus_rate: int | None = None  # session.started's output rate when the reply audio is Opus
        self._encoders: dict[int, OpusEncoder] = {}  # each reply's Opus stream, by response_id

    async def send(self, event: ServerEvent) -> None:
        if isinstance(event, ev.SessionStarted):  # the reply audio's format from now on
            self._opus_rate = event.output.sample_rate if event.output.format == "opus" else None
            self._encoders.clear()
        elif isinstance(event, ev.ResponseDone):  # the reply's last packet before its end
            encoder = self._encoders.pop(event.response_id, None)
            if encoder is not None:
                for packet in await run_codec(encoder.flush):
                    await self._put(audio_frame(event.response_id, packet))
        elif isinstance(event, ev.ResponseCancelled):
            self._encoders.pop(event.response_id, None)  # cut: its held tail is not worth a packet
        await self._put(encode_event(event))

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        if self._opus_rate is None:
            await self._put(audio_frame(response_id, pcm16))
            return
        encoder = self._encoders.get(response_id)
        if encoder is None:  # the reply's first packet goes alone: it need not wait for the chunk's others
            encoder = self._encoders[response_id] = OpusEncoder(self._opus_rate)
            first, pcm16 = pcm16[: 2 * encoder.frame], pcm16[2 * encoder.frame:]
            for packet in await run_codec(encoder.encode, first):
                await self._put(audio_frame(response_id, packet))
            if not pcm16:
                return
        for packet in await run_codec(encoder.encode, pcm16):
            await self._put(audio_frame(response_id, packet))

    async def _put(self, item: str | bytes) -> None:
        if self.closed:
            return
        if not self._q.full():
            self._q.put_nowait(item)
            return
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can swallow a
            # cancellation that races with the put completing, which left a cancelled
            # reply running forever and its session unable to close.
            async with asyncio.timeout(self.timeout_s):
                await self._q.put(item)
        except TimeoutError:
            logger.warning("client not reading for %.1f s: closing", self.timeout_s)
            self.closed = True
            self._closer = asyncio.ensure_future(self.ws.close(1008, "client too slow: not reading"))
            raise SlowClient("client too slow") from None

    async def run(self) -> None:
        """Writer loop: send queued frames until :meth:`close` or the socket closes."""
        from websockets.exceptions import ConnectionClosed

        try:
            while (item := await self._q.get()) is not None:
                await self.ws.send(item)
        except ConnectionClosed:
            pass
        finally:
            self.closed = True

    def close(self) -> None:
        """Stop the writer after what is queued (never blocks)."""
        self.closed = True
        try:
            self._q.put_nowait(None)
        except asyncio.QueueFull:
            pass
