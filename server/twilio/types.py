"""The messages of Twilio Media Streams (bidirectional, ``<Connect><Stream>``), as Twilio
documents them: https://www.twilio.com/docs/voice/media-streams/websocket-messages.

Twilio → voxpipe: ``connected``, ``start``, ``media``, ``dtmf``, ``mark``, ``stop`` (JSON text
frames; audio is base64 G.711 μ-law, 8 kHz, mono). voxpipe → Twilio: ``media``, ``mark``,
``clear``. Fields voxpipe does not use are accepted and ignored (Twilio adds some now and then).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

TWILIO_PATH = "/twilio"
"""Where a Twilio ``<Stream url="wss://HOST/twilio">`` connects."""
MULAW = "audio/x-mulaw"
"""The only encoding Twilio streams (8 kHz, mono)."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")


class Connected(_Message):
    """The first message: the protocol to expect."""

    event: Literal["connected"]
    protocol: str = "Call"
    version: str = ""


class MediaFormat(_Message):
    """The stream's audio (field names as Twilio spells them)."""

    encoding: str
    sampleRate: int
    channels: int = 1


class StartInfo(_Message):
    streamSid: str = Field(min_length=1)
    callSid: str = ""
    accountSid: str = ""
    tracks: list[str] = Field(default_factory=lambda: ["inbound"])
    mediaFormat: MediaFormat
    customParameters: dict[str, str] = Field(default_factory=dict)


class Start(_Message):
    """The stream's metadata: its ``streamSid`` (every message voxpipe sends names it), the
    media format, and the ``<Parameter>`` values of the TwiML (``customParameters``)."""

    event: Literal["start"]
    start: StartInfo


class MediaInfo(_Message):
    track: str = "inbound"
    chunk: str = ""
    timestamp: str = ""
    payload: str


class Media(_Message):
    """20 ms of the caller's audio (base64 μ-law)."""

    event: Literal["media"]
    media: MediaInfo


class MarkInfo(_Message):
    name: str


class Mark(_Message):
    """Twilio played the audio voxpipe sent before the ``mark`` of this name (or ``clear``
    dropped it)."""

    event: Literal["mark"]
    mark: MarkInfo


class DtmfInfo(_Message):
    track: str = "inbound_track"
    digit: str


class Dtmf(_Message):
    """The caller pressed a key."""

    event: Literal["dtmf"]
    dtmf: DtmfInfo


class Stop(_Message):
    """The call ended (or ``<Stop>``): the last message."""

    event: Literal["stop"]


TwilioMessage = Annotated[Connected | Start | Media | Mark | Dtmf | Stop, Field(discriminator="event")]
"""Any message Twilio sends."""
EVENTS = ("connected", "start", "media", "dtmf", "mark", "stop")
"""The ``event`` values Twilio sends."""


class TwilioError(ValueError):
    """A message voxpipe cannot use: it is logged and dropped; the call goes on."""
