"""The session's outbox over a peer connection: JSON events on the ``events`` data channel,
reply audio into the :class:`~server.webrtc.tracks.ReplyTrack`.

Events go through a bounded queue drained by one writer task, as on the WebSocket
(:class:`server.outbox.WsOutbox`): the writer waits for the data channel to open (the
session's first events — ``session.started`` — are queued while ICE and DTLS connect), and
while the channel's send buffer is over :data:`HIGH_WATER` bytes. Producers wait for room; a
client that reads nothing for ``timeout_s`` raises :class:`~server.outbox.SlowClient` and
its peer is closed. Reply audio needs no queue here: the Responder paces it in real time,
and the track sends it at that pace. ``response.cancelled`` drops the reply's queued audio,
``response.paused`` / ``response.resumed`` hold it back and let it go on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from pipeline.session import events as ev
from pipeline.session.events import ServerEvent

from ..outbox import SlowClient
from ..protocol import encode_event
from .tracks import ReplyTrack

logger = logging.getLogger(__name__)

HIGH_WATER = 256 * 1024
"""The writer waits while the data channel holds more than this many bytes unsent (as a
WebSocket's write buffer)."""
LOW_WATER = 64 * 1024
"""... until it has drained to this (the channel's ``bufferedAmountLowThreshold``)."""


class RtcOutbox:
    """Outbox of one WebRTC session.

    Args:
        track: the reply track.
        maxsize: events queued before producers wait.
        timeout_s: longest wait for room before the client is dropped as too slow.
        on_slow: called once when that happens (the peer closes itself).

    Attributes:
        sent_bytes: bytes of events handed to the data channel.
        audio_bytes: bytes of reply PCM16 handed to the track.
    """

    def __init__(self, track: ReplyTrack, *, maxsize: int, timeout_s: float,
                 on_slow: Callable[[], None] = lambda: None) -> None:
        self.track = track
        self.timeout_s = timeout_s
        self.on_slow = on_slow
        self._q: asyncio.Queue[str | None] = asyncio.Queue(maxsize=maxsize)
        self._channel: Any = None  # the open RTCDataChannel, once it is
        self._opened = asyncio.Event()
        self._drained = asyncio.Event()
        self.closed = False
        self.sent_bytes = self.audio_bytes = 0

    def attach(self, channel: Any) -> None:
        """Send through ``channel`` (an open aiortc ``RTCDataChannel``) from now on."""
        self._channel = channel
        channel.bufferedAmountLowThreshold = LOW_WATER
        channel.on("bufferedamountlow", self._drained.set)
        channel.on("close", self._drained.set)  # a writer waiting for room stops waiting
        self._opened.set()

    async def send(self, event: ServerEvent) -> None:
        if isinstance(event, ev.ResponseCancelled):
            self.track.drop(event.response_id)
        elif isinstance(event, ev.ResponsePaused):
            self.track.hold(event.response_id, True)
        elif isinstance(event, ev.ResponseResumed):
            self.track.hold(event.response_id, False)
        elif isinstance(event, ev.SessionStarted):
            self.track.clear()
        await self._put(encode_event(event))

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        if self.closed:
            return
        self.audio_bytes += len(pcm16)
        self.track.push(response_id, pcm16)

    async def _put(self, text: str) -> None:
        if self.closed:
            return
        if not self._q.full():
            self._q.put_nowait(text)
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._q.put(text)
        except TimeoutError:
            logger.warning("WebRTC client not reading its events for %.1f s: closing", self.timeout_s)
            self.closed = True
            self.on_slow()
            raise SlowClient("client too slow") from None

    async def run(self) -> None:
        """Writer loop: send queued events once the channel is open, until :meth:`close`
        or the channel closes."""
        await self._opened.wait()
        channel = self._channel
        if channel is None:  # closed before the channel opened
            self.closed = True
            return
        try:
            while (text := await self._q.get()) is not None:
                while channel.readyState == "open" and channel.bufferedAmount > HIGH_WATER:
                    self._drained.clear()
                    await self._drained.wait()
                if channel.readyState != "open":
                    break
                channel.send(text)
                self.sent_bytes += len(text.encode())
        except Exception:  # the channel or its transport went away: nothing more to send
            logger.debug("WebRTC events channel closed while sending", exc_info=True)
        finally:
            self.closed = True

    def close(self) -> None:
        """Stop the writer after what is queued (never blocks); a writer still waiting for
        the channel to open is let go."""
        self.closed = True
        try:
            self._q.put_nowait(None)
        except asyncio.QueueFull:
            pass
        if self._channel is None:
            self._opened.set()
