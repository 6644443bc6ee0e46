"""What the WebRTC edge's modules share: its constants and the refusal of an offer."""

from __future__ import annotations

import http
import json

from pipeline.session.events import ClientEvent

from ..protocol import parse_client_event

OFFER_PATH = "/webrtc/offer"
"""The signalling endpoint: ``POST`` an SDP offer (JSON), get the SDP answer."""
EVENTS_LABEL = "events"
"""The data channel that carries the protocol's JSON events, both ways."""
TRACK_RATE = 48000
"""Sample rate of the audio the peer connection decodes and of the reply track (Hz): Opus's own."""
INPUT_CHANNELS = 2
"""Channels of the decoded audio the session is fed (aiortc's Opus decoder gives interleaved
stereo; the session downmixes)."""
FRAME_S = 0.020
"""One reply frame (s): 960 samples at 48 kHz, one Opus packet."""
MAX_OFFER_BYTES = 64 * 1024
"""Largest request body taken (bytes); a browser's offer with one audio track and a data
channel is 2–6 KB."""
CONNECT_TIMEOUT_S = 30.0
"""A peer connection not connected (ICE, DTLS, then the ``events`` channel open) this long
after its answer is closed, and its session with it."""
INSTALL_HINT = ("WebRTC needs the aiortc package, which is not installed: pip install 'voxpipe[webrtc]' "
                "(or pip install aiortc), then restart the server")
"""The 501 answer's sentence when aiortc is missing."""


AUDIO_FIELDS = {"sample_rate": TRACK_RATE, "format": "pcm16", "channels": INPUT_CHANNELS,
                "output_sample_rate": TRACK_RATE, "output_format": "pcm16"}
"""What a ``session.start`` over WebRTC declares, whatever the client sent: the decoded
track's format in, the reply track's out (on the wire the codec is Opus both ways)."""


def parse_event(text: str) -> ClientEvent:
    """One message of the ``events`` channel as a client event (:func:`server.protocol.
    parse_client_event`), a ``session.start``'s audio fields replaced by :data:`AUDIO_FIELDS`
    before it is checked: the client chooses the rest (system prompt, language, VAD, end of
    turn, tools).

    Raises:
        ProtocolError: as :func:`~server.protocol.parse_client_event`.
    """
    if "session.start" in text:
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError):
            raw = None  # parse_client_event says why
        if isinstance(raw, dict) and raw.get("type") == "session.start":
            text = json.dumps({**raw, **AUDIO_FIELDS})
    return parse_client_event(text)


class OfferError(Exception):
    """An offer refused: HTTP ``status`` and a one-line ``message`` for the client
    (``retry_after_s``: a ``Retry-After`` header, for 503).

    Args:
        status: the HTTP status. message: one sentence, no trailing newline.
        retry_after_s: seconds, or None.
    """

    def __init__(self, status: http.HTTPStatus, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s
