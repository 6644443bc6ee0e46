"""Types of the Realtime room: the client events voxpipe accepts at ``/v1/realtime``, the
session settings they carry, and the dialect a connection speaks.

The event shapes follow the OpenAI Realtime API reference (the ``openai`` package's
``openai/types/realtime`` for the GA API and ``openai/types/beta/realtime`` for the beta
one, ``OpenAI-Beta: realtime=v1``). Fields voxpipe does not use are ignored; the fields it
uses are validated (pydantic). docs/REALTIME.md lists what is supported.
"""

from __future__ import annotations

import base64
import binascii
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pipeline.session.events import MAX_TEXT_CHARS, ClientTool

Dialect = Literal["ga", "beta"]
"""Which event names a connection gets: ``ga`` (``response.output_audio.delta``,
``conversation.item.added``, ...) or ``beta`` (``response.audio.delta``,
``conversation.item.created``, ...)."""

REALTIME_RATE = 24000
"""The only audio rate of the Realtime API's PCM format (Hz): input and output."""

BETA_SESSION_KEYS = frozenset({"input_audio_format", "output_audio_format", "modalities", "turn_detection",
                               "input_audio_transcription", "voice", "temperature", "max_response_output_tokens"})
"""``session.update`` keys only the beta shape has at the top of ``session``."""


class _Event(BaseModel):
    model_config = ConfigDict(extra="ignore")
    event_id: str | None = Field(None, max_length=512, description="client id, echoed in an error about it")


class SessionUpdate(_Event):
    """``session.update``: ``session`` is the beta or the GA shape (read by
    :func:`server.realtime.config.read_update`)."""

    type: Literal["session.update"]
    session: dict[str, Any]


class AudioAppend(_Event):
    """``input_audio_buffer.append``: ``audio`` is base64 PCM16 mono, 24 kHz (validated
    and decoded: ``pcm`` holds the bytes)."""

    type: Literal["input_audio_buffer.append"]
    audio: str

    @field_validator("audio")
    @classmethod
    def _base64(cls, audio: str) -> str:
        try:
            base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("not valid base64") from None
        return audio

    @property
    def pcm(self) -> bytes:
        return base64.b64decode(self.audio)


class AudioCommit(_Event):
    type: Literal["input_audio_buffer.commit"]


class AudioClear(_Event):
    type: Literal["input_audio_buffer.clear"]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = Field(None, max_length=MAX_TEXT_CHARS)


class Item(BaseModel):
    """A user message item; voxpipe accepts ``input_text`` parts."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, max_length=64)
    type: Literal["message"]
    role: Literal["user"]
    content: list[ContentPart] = Field(min_length=1)


class OutputItem(BaseModel):
    """A ``function_call_output`` item: the client's result of function call ``call_id``
    (``output``: text, JSON or words, for the model)."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = Field(None, max_length=64)
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=64)
    output: str = Field(max_length=MAX_TEXT_CHARS)


class ItemCreate(_Event):
    """``conversation.item.create``: a user message, or a function call's output."""

    type: Literal["conversation.item.create"]
    item: Annotated[Item | OutputItem, Field(discriminator="type")]


class ResponseCreate(_Event):
    """``response.create``; its ``response`` overrides (instructions, modalities...) are
    ignored."""

    type: Literal["response.create"]


class ResponseCancel(_Event):
    type: Literal["response.cancel"]


ClientEvent = Annotated[SessionUpdate | AudioAppend | AudioCommit | AudioClear | ItemCreate | ResponseCreate
                        | ResponseCancel, Field(discriminator="type")]
"""Any Realtime client event voxpipe accepts (a pydantic discriminated union on ``type``)."""

CLIENT_TYPES = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                "input_audio_buffer.clear", "conversation.item.create", "response.create", "response.cancel")


@dataclass(slots=True)
class Settings:
    """A connection's session settings as ``session.update`` left them.

    Attributes:
        instructions: the system prompt (None: the server's default).
        server_vad: turns end at silence (True) or at ``input_audio_buffer.commit`` +
            ``response.create`` (False: ``turn_detection: null``).
        end_of_turn: how VAD turns end: ``smart-turn`` (``semantic_vad``), ``silence``
            (``server_vad``), or None (the server's ``--end-of-turn``).
        eagerness: ``semantic_vad``'s ``eagerness`` (None: the server's).
        dialect: the event names this connection gets.
        tools: the client's function tools (declared to the session as client tools).
        tool_choice: as the client wrote it (reported back): ``auto``, ``none``,
            ``required`` or ``{"type": "function", "name": ...}``.
        voice: the voice that speaks the replies (a name from ``GET /v1/voices``; None:
            each reply's language picks the server's voice).
    """

    instructions: str | None = None
    server_vad: bool = True
    end_of_turn: Literal["silence", "smart-turn"] | None = None
    eagerness: Literal["auto", "low", "medium", "high"] | None = None
    dialect: Dialect = "ga"
    tools: tuple[ClientTool, ...] = ()
    tool_choice: str | dict[str, Any] = "auto"
    voice: str | None = None


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``prefix`` + ``_`` + 20 hex digits (random)."""
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


class RealtimeError(ValueError):
    """A client event voxpipe cannot act on: becomes an ``error`` event (Realtime shape)
    with ``type`` ``invalid_request_error``, this ``code`` and ``param``."""

    def __init__(self, code: str, message: str, *, param: str | None = None, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code, self.param, self.event_id = code, param, event_id
