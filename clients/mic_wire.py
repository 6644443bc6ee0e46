"""``voxpipe mic``'s audio on the wire: PCM16, or Opus both ways when the server has it."""

from __future__ import annotations

import asyncio
import json

from audio.opus import OpusEncoder, ReplyDecoder, run_codec
from audio.pcm import RATE
from clients.turn import OPUS_INPUT_BITRATE

OUT_RATE = 24000
"""The reply audio rate asked for (Hz): an Opus rate, so the same for PCM and Opus."""
CODECS = ("auto", "opus", "pcm")
"""``--codec``: Opus both ways, falling back to PCM16 when the server has no Opus (``auto``,
the default), Opus only, or PCM16 only."""


class Wire:
    """The session's audio on the wire: ``session.start`` and what it settled. With Opus
    (``codec`` ``auto`` or ``opus``) the microphone's 20 ms frames go out as Opus packets and
    reply packets are decoded (:mod:`audio.opus`, on its codec threads); a server that
    answers the Opus ``session.start`` with ``bad_event`` (no Opus) gets PCM16 instead
    under ``auto``. Nothing is sent before ``session.started`` (:attr:`started`)."""

    def __init__(self, ws, codec: str, turn: dict[str, str]) -> None:
        if codec not in CODECS:
            raise ValueError(f"--codec {codec!r}: use one of {', '.join(CODECS)}")
        self.ws, self.codec, self.turn = ws, codec, turn
        self.started = asyncio.Event()
        self.opus_in = self.opus_out = False  # what session.started settled
        self._asked_opus = codec != "pcm"
        self._encoder: OpusEncoder | None = None
        self._replies: ReplyDecoder | None = None

    async def start(self, *, opus: bool | None = None) -> None:
        """Send ``session.start`` (Opus both ways unless PCM was chosen or refused)."""
        opus = self._asked_opus if opus is None else opus
        self._asked_opus = opus
        fmt = "opus" if opus else "pcm16"
        await self.ws.send(json.dumps({"type": "session.start", "sample_rate": RATE, "format": fmt, "channels": 1,
                                       "output_sample_rate": OUT_RATE, "output_format": fmt, **self.turn}))

    async def answered(self, ev: dict) -> bool:
        """Take the server's answer to ``session.start``: True when it refused Opus and a
        PCM16 ``session.start`` went out instead (the event is then handled)."""
        if ev["type"] == "session.started":
            self.opus_in, self.opus_out = ev["input"]["format"] == "opus", ev["output"]["format"] == "opus"
            self._encoder = OpusEncoder(RATE, OPUS_INPUT_BITRATE) if self.opus_in else None
            self._replies = ReplyDecoder(OUT_RATE) if self.opus_out else None
            self.started.set()
        elif (ev["type"] == "error" and ev.get("code") == "bad_event" and self._asked_opus
              and self.codec == "auto" and not self.started.is_set()):
            await self.start(opus=False)
            return True
        return False

    async def encode(self, frame: bytes) -> list[bytes]:
        """A microphone frame (PCM16, 16 kHz) → the binary messages to send."""
        if self._encoder is None:
            return [frame]
        return await run_codec(self._encoder.encode, frame)

    def decode(self, response_id: int, payload: bytes) -> bytes:
        """A reply-audio frame's payload → PCM16 at :data:`OUT_RATE`."""
        return payload if self._replies is None else self._replies.pcm16(response_id, payload)
