"""Twilio → voxpipe: the ``/twilio`` side of :meth:`server.app.VoxpipeServer.handle` (which
reads, paces and budgets the frames; this parses and acts on them). docs/TWILIO.md.

``start`` starts the session (PCM16 at 8 kHz both ways, server VAD; the TwiML's
``<Parameter>`` values ``system_prompt`` and ``language`` apply; with ``--token`` the
``token`` parameter must match: Twilio's ``<Stream>`` URL takes no query string and Twilio
sends no ``Authorization`` header); ``media`` is the caller's audio (μ-law → PCM16, through
the client's audio budget); ``stop`` ends it. A message that is not Twilio's (bad JSON, an
unknown ``event``, a payload that is not base64) is logged, counted
(``voxpipe_client_errors_total{code="bad_event"}``) and dropped: the call goes on.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from pydantic import TypeAdapter, ValidationError

from audio.mulaw import MULAW_RATE, MulawCodec
from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.session.events import SessionStart
from pipeline.session.session import Session

from .outbox import TwilioOutbox
from .types import EVENTS, MULAW, Media, Start, Stop, TwilioError, TwilioMessage

logger = logging.getLogger(__name__)

_ADAPTER: TypeAdapter = TypeAdapter(TwilioMessage)

Feed = Callable[[bytes], Awaitable[None]]
"""Hands PCM16 8 kHz bytes to the session through the client's audio budget."""
Pace = Callable[[int], Awaitable[bool]]
"""Waits as the client's text-frame budget says for a frame of that many bytes; False: dropped."""
Outcome = Literal["stop", "denied"] | None
"""What a frame did to the call: ``stop`` (Twilio ended it), ``denied`` (a wrong token),
None (it goes on)."""


def parse_message(text: str | bytes):
    """One frame → a Twilio message (:data:`~server.twilio.types.TwilioMessage`).

    Raises:
        TwilioError: a binary frame, not a JSON object, an unknown ``event``, or fields
            missing or of the wrong type.
    """
    if isinstance(text, bytes):
        raise TwilioError("a binary frame: Twilio sends JSON text frames")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TwilioError(f"not JSON: {str(exc)[:100]}") from None
    if not isinstance(raw, dict):
        raise TwilioError("not a JSON object")
    kind = raw.get("event")
    if kind not in EVENTS:
        raise TwilioError(f"unknown event {str(kind)[:64]!r} (Twilio sends {', '.join(EVENTS)})")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise TwilioError(f"invalid {kind}: {'.'.join(map(str, first['loc'][1:]))}: {first['msg']}") from None


class TwilioWire:
    """One ``/twilio`` connection's caller side.

    Args:
        out: the connection's outbox.
        session: the connection's session (started by Twilio's ``start``).
        cfg: the server's configuration (its ``--token``).
    """

    def __init__(self, out: TwilioOutbox, session: Session, cfg: VoxpipeConfig) -> None:
        self.out, self.session, self.cfg = out, session, cfg
        self._codec = MulawCodec()
        self.dropped = 0  # messages logged and dropped

    async def frame(self, frame: str | bytes, feed: Feed, pace: Pace) -> Outcome:
        """Act on one frame: ``media`` paced by ``feed`` (the audio budget), every other
        frame by ``pace`` (the text-frame budget) first."""
        try:
            msg = parse_message(frame)
            if isinstance(msg, Media):
                await self._media(msg, feed)
                return None
            if not await pace(len(frame)):
                return None
            if isinstance(msg, Start):
                return await self._start(msg)
            if isinstance(msg, Stop):
                logger.info("twilio stream %s: stopped by Twilio", self.out.stream_sid)
                return "stop"
            logger.debug("twilio stream %s: %s", self.out.stream_sid, msg)  # connected, mark, dtmf
        except TwilioError as exc:
            self._drop(str(exc))
        return None

    async def _start(self, msg: Start) -> Outcome:
        info = msg.start
        fmt = info.mediaFormat
        if (fmt.encoding, fmt.sampleRate, fmt.channels) != (MULAW, MULAW_RATE, 1):
            raise TwilioError(f"media format {fmt.encoding} at {fmt.sampleRate} Hz x{fmt.channels}: voxpipe takes "
                              f"{MULAW} at {MULAW_RATE} Hz, mono")
        token = self.cfg.server.token
        if token and not hmac.compare_digest(info.customParameters.get("token", "").encode(), token.encode()):
            metrics.EDGE_REFUSALS.labels("token").inc()
            logger.warning("twilio stream %s: refused: a valid token is required (<Parameter name=\"token\">)",
                           info.streamSid)
            return "denied"
        self.out.stream_sid = info.streamSid
        params = info.customParameters
        await self.session.start(SessionStart(
            type="session.start", sample_rate=MULAW_RATE, format="pcm16", channels=1,
            output_sample_rate=MULAW_RATE, output_format="pcm16", system_prompt=params.get("system_prompt") or None,
            language=params.get("language") or None, vad=True, end_of_turn=None, eagerness=None, tools=[],
            voice=None))
        logger.info("twilio stream %s started (call %s)", info.streamSid, info.callSid or "?")
        return None

    async def _media(self, msg: Media, feed: Feed) -> None:
        if self.out.stream_sid is None:
            raise TwilioError("media before start")
        if msg.media.track not in ("inbound", "inbound_track"):
            return  # the call's other leg, if both tracks are streamed
        try:
            mulaw = base64.b64decode(msg.media.payload, validate=True)
        except (binascii.Error, ValueError):
            raise TwilioError("a media payload that is not base64") from None
        await feed(self._codec.decode(mulaw))

    def _drop(self, why: str) -> None:
        """Count a message dropped; log the 1st, 10th, 100th, ... (a stream of bad media
        messages, 50 a second, must not flood the log)."""
        self.dropped += 1
        metrics.ERRORS.labels("bad_event").inc()
        if str(self.dropped).rstrip("0") == "1":
            logger.warning("twilio stream %s: dropped a message (%d so far): %s",
                           self.out.stream_sid or "(not started)", self.dropped, why)
