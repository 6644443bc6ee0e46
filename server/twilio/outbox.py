"""voxpipe → Twilio: the reply's audio as ``media`` messages (base64 μ-law, 8 kHz), a
``mark`` after each reply, and ``clear`` when a reply is cut (barge-in), so the caller stops
hearing it at once instead of after the audio Twilio has buffered. voxpipe's other events
have no place in Twilio's protocol: they are not sent (errors are logged)."""

from __future__ import annotations

import base64
import json
import logging

from audio.mulaw import MulawCodec
from pipeline.session import events as ev
from server.outbox import WsOutbox

logger = logging.getLogger(__name__)


class TwilioOutbox(WsOutbox):
    """The outbox of one ``/twilio`` connection (a :class:`WsOutbox`: bounded, a slow reader
    is dropped). Nothing is sent before :attr:`stream_sid` is known (Twilio's ``start``).

    Attributes:
        stream_sid: the stream every message names (``start.streamSid``).
        marks: names of the marks sent, in order (``response-N``).
    """

    def __init__(self, ws, *, maxsize: int, timeout_s: float) -> None:
        super().__init__(ws, maxsize=maxsize, timeout_s=timeout_s)
        self.stream_sid: str | None = None
        self.marks: list[str] = []
        self._codec = MulawCodec()

    async def send(self, event: ev.ServerEvent) -> None:
        if isinstance(event, ev.ResponseCancelled):
            await self._twilio({"event": "clear"})  # the caller stops hearing the cut reply now
        elif isinstance(event, ev.ResponseDone):
            name = f"response-{event.response_id}"
            self.marks.append(name)
            await self._twilio({"event": "mark", "mark": {"name": name}})
        elif isinstance(event, ev.Error):
            logger.warning("twilio stream %s: %s: %s", self.stream_sid, event.code, event.message)

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        """Reply audio (PCM16 at 8 kHz, the session's output rate) → one ``media`` message."""
        mulaw = self._codec.encode(pcm16)
        if mulaw:
            await self._twilio({"event": "media", "media": {"payload": base64.b64encode(mulaw).decode("ascii")}})

    async def _twilio(self, message: dict) -> None:
        if self.stream_sid is not None:
            await self._put(json.dumps({**message, "streamSid": self.stream_sid}))
