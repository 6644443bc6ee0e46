"""Wire protocol v1: JSON text events with a ``type`` field, validated at the edge.

Client → server events are a pydantic discriminated union (:data:`ClientEvent`);
:func:`parse_client_event` turns any text frame into an event or a
:class:`ProtocolError` with an error ``code``. Server → client events are built by
:func:`server_event`. Binary server frames carry reply audio: a 4-byte little-endian
unsigned ``response_id`` followed by PCM16 mono samples at the session's output rate.
The full reference is docs/PROTOCOL.md.
"""

from __future__ import annotations

import json
import struct
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

PROTOCOL_VERSION = 1
MAX_TEXT_CHARS = 8000
"""Longest ``text.input`` / ``system_prompt`` accepted (characters)."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class SessionStart(_Event):
    """Start (or restart) a session and declare the audio formats."""

    type: Literal["session.start"]
    sample_rate: int = Field(16000, ge=8000, le=48000, description="input rate (Hz)")
    format: Literal["pcm16", "f32"] = "pcm16"
    channels: int = Field(1, ge=1, le=2, description="1 (mono) or 2 (interleaved stereo)")
    output_sample_rate: int = Field(24000, ge=8000, le=48000, description="reply audio rate (Hz)")
    system_prompt: str | None = Field(None, max_length=MAX_TEXT_CHARS)
    language: str | None = Field(None, min_length=2, max_length=8)
    vad: bool = Field(True, description="server VAD finds turns; false: a turn ends at input.end")


class InputEnd(_Event):
    """The user's turn is over now (end of file, push-to-talk release)."""

    type: Literal["input.end"]


class TextInput(_Event):
    """A typed user turn."""

    type: Literal["text.input"]
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)


class ResponseCancel(_Event):
    """Stop the current reply."""

    type: Literal["response.cancel"]


class SessionEnd(_Event):
    """Close the session; the server closes the socket with code 1000."""

    type: Literal["session.end"]


ClientEvent = Annotated[
    SessionStart | InputEnd | TextInput | ResponseCancel | SessionEnd, Field(discriminator="type")
]
_ADAPTER: TypeAdapter = TypeAdapter(ClientEvent)
CLIENT_TYPES = ("session.start", "input.end", "text.input", "response.cancel", "session.end")


class ProtocolError(ValueError):
    """A client frame that is not a valid event; ``code`` goes into the error event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_client_event(text: str):
    """Parse one text frame into a client event.

    Raises:
        ProtocolError: ``bad_json`` (not JSON, or not an object), ``unknown_type``
            (missing or unknown ``type``), ``bad_event`` (fields missing or wrong type).
    """
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError("bad_json", f"text frame is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ProtocolError("bad_json", f"event must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in CLIENT_TYPES:
        shown = repr(kind) if len(repr(kind)) <= 64 else repr(kind)[:60] + "...'"
        raise ProtocolError("unknown_type", f"unknown event type {shown}; expected one of {list(CLIENT_TYPES)}")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:])) or 'event'}: {e['msg']}" for e in exc.errors())
        raise ProtocolError("bad_event", f"invalid {kind}: {problems}") from None


SERVER_TYPES = (
    "session.started", "speech.started", "speech.stopped", "transcript.partial", "transcript.final",
    "turn.empty", "response.started", "response.text.delta", "response.done", "response.cancelled", "error",
)


def server_event(kind: str, **fields) -> str:
    """Serialize a server → client event as JSON text.

    Raises:
        ValueError: ``kind`` is not a server event type.
    """
    if kind not in SERVER_TYPES:
        raise ValueError(f"not a server event type: {kind}")
    return json.dumps({"type": kind, **fields}, ensure_ascii=False)


def error_event(code: str, message: str, *, fatal: bool = False) -> str:
    """An ``error`` event; ``fatal`` means the server will close the connection."""
    return server_event("error", code=code, message=message, fatal=fatal)


AUDIO_HEADER = struct.Struct("<I")


def audio_frame(response_id: int, pcm16: bytes) -> bytes:
    """A binary reply-audio frame: ``<I`` response_id + PCM16 mono bytes."""
    return AUDIO_HEADER.pack(response_id) + pcm16


def parse_audio_frame(frame: bytes) -> tuple[int, bytes]:
    """Split a binary reply-audio frame into (response_id, PCM16 bytes).

    Raises:
        ValueError: the frame is shorter than its header.
    """
    if len(frame) < AUDIO_HEADER.size:
        raise ValueError("audio frame shorter than its 4-byte header")
    return AUDIO_HEADER.unpack_from(frame)[0], frame[AUDIO_HEADER.size :]
