"""The wire protocol's events, both directions, as typed classes (protocol version 1).

Every JSON text frame is one event with a ``type`` field (docs/PROTOCOL.md is the
reference; docs/protocol.schema.json is generated from these classes). Client events are
validated strictly at the edge (:func:`server.protocol.parse_client_event`); server
events are built by the session as these classes and serialized only at the edge
(:func:`server.protocol.encode_event`). Binary frames (audio) are not events: the client
sends raw samples in its declared format, the server sends a 4-byte ``response_id``
header + PCM16 (:func:`audio.frames.audio_frame`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from audio.pcm import OPUS_RATES, RATE
from pipeline.errors import BusyReason
from pipeline.serving.types import Condition

PROTOCOL_VERSION = 1
MAX_TEXT_CHARS = 8000
"""Longest ``text.input`` / ``system_prompt`` accepted (characters)."""


# ---- client → server --------------------------------------------------------------------


Eagerness = Literal["auto", "low", "medium", "high"]
"""smart-turn's eagerness names (:data:`pipeline.config.EAGERNESS`)."""


class _ClientEvent(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


MAX_CLIENT_TOOLS = 32
"""Most tools a client may declare in ``session.start``."""


class ClientTool(_ClientEvent):
    """A function the client offers (OpenAI's function tool, flattened as in the Realtime API)."""

    type: Literal["function"] = "function"
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="letters, digits, _ or -; at most 64")
    description: str = Field("", max_length=2000)
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                       description="JSON Schema of the arguments: an object schema")


class SessionStart(_ClientEvent):
    """Start (or restart) a session and declare the audio formats."""

    type: Literal["session.start"]
    sample_rate: int = Field(RATE, ge=8000, le=48000, description="input rate (Hz)")
    format: Literal["pcm16", "f32", "opus"] = Field(
        "pcm16", description="little-endian PCM16, float32 in [-1, 1], or Opus (one packet per binary frame; "
                             "sample_rate then one of 8000, 12000, 16000, 24000, 48000)")
    channels: int = Field(1, ge=1, le=2, description="1 (mono) or 2 (interleaved stereo)")
    output_sample_rate: int = Field(24000, ge=8000, le=48000, description="reply audio rate (Hz)")
    output_format: Literal["pcm16", "opus"] = Field(
        "pcm16", description="reply audio: PCM16, or one 20 ms Opus packet per binary frame (output_sample_rate "
                             "then one of 8000, 12000, 16000, 24000, 48000)")
    system_prompt: str | None = Field(None, max_length=MAX_TEXT_CHARS, description="replaces the system prompt")
    language: str | None = Field(None, min_length=2, max_length=8, description="ISO code; null: detect")
    voice: str | None = Field(
        None, min_length=1, max_length=200,
        description="the voice that speaks every reply (a name from GET /v1/voices); null: each reply's turn "
                    "language picks the server's voice for it")
    vad: bool = Field(True, description="server VAD finds turns; false: a turn ends at input.end")
    end_of_turn: Literal["silence", "smart-turn"] | None = Field(
        None, description="how VAD turns end: after a silence, or when the end-of-turn model says the turn is "
                          "complete (needs a server started with --end-of-turn smart-turn); null: the server's")
    eagerness: Eagerness | None = Field(
        None, description="smart-turn: how soon a turn ends (low waits longest); null: the server's")
    tools: list[ClientTool] = Field(
        default_factory=list, max_length=MAX_CLIENT_TOOLS,
        description="functions the client runs itself: the model may call them (tool.call with runs_on "
                    "'client'); the client answers each call with tool.result")

    @model_validator(mode="after")
    def _opus_rates(self) -> SessionStart:
        for what, fmt, rate in (("sample_rate", self.format, self.sample_rate),
                                ("output_sample_rate", self.output_format, self.output_sample_rate)):
            if fmt == "opus" and rate not in OPUS_RATES:
                raise ValueError(f"{what} {rate} is not an Opus rate: use one of {', '.join(map(str, OPUS_RATES))}")
        return self


class InputEnd(_ClientEvent):
    """The user's turn is over now (end of file, push-to-talk release)."""

    type: Literal["input.end"]


class TextInput(_ClientEvent):
    """A typed user turn."""

    type: Literal["text.input"]
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, json_schema_extra={"pattern": r"\S"},
                      description="not blank: at least one non-whitespace character")

    @field_validator("text")
    @classmethod
    def _not_blank(cls, text: str) -> str:
        if not text.strip():
            raise ValueError("text is blank (only whitespace)")
        return text


class ToolResultIn(_ClientEvent):
    """The result of a call the client ran (a ``tool.call`` with ``runs_on: "client"``)."""

    type: Literal["tool.result"]
    call_id: str = Field(min_length=1, max_length=64)
    output: str = Field(max_length=MAX_TEXT_CHARS, description="the result as text (JSON or words), for the model")


class ResponseCancel(_ClientEvent):
    """Stop the current reply."""

    type: Literal["response.cancel"]


class SessionEnd(_ClientEvent):
    """Close the session; the server closes the socket with code 1000."""

    type: Literal["session.end"]


ClientEvent = Annotated[SessionStart | InputEnd | TextInput | ToolResultIn | ResponseCancel | SessionEnd,
                        Field(discriminator="type")]
"""Any client → server event (a pydantic discriminated union on ``type``)."""

CLIENT_EVENTS: tuple[type[BaseModel], ...] = (SessionStart, InputEnd, TextInput, ToolResultIn, ResponseCancel,
                                              SessionEnd)


# ---- server → client --------------------------------------------------------------------


class _ServerEvent(BaseModel):
    # The server always sends every field (``type`` included, though it has a default):
    # the schema of what it sends marks them all required.
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_serialization_defaults_required=True)


TurnId = Annotated[int, Field(ge=1, description="the turn this event belongs to (1, 2, ... per session)")]
"""Identifies a user turn within a session: speech (a turn that continues after a short
pause keeps its id), a ``text.input``, or an ``input.end`` with no speech. Ids count up
from 1 in the order turns begin; every per-turn server event carries its turn's."""


class AudioFormat(BaseModel):
    """An audio format as ``session.started`` reports it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    sample_rate: int = Field(description="Hz")
    format: Literal["pcm16", "f32", "opus"]
    channels: int


class SessionStarted(_ServerEvent):
    """The session (re)started with these formats."""

    type: Literal["session.started"] = "session.started"
    session_id: str
    protocol: int = PROTOCOL_VERSION
    input: AudioFormat
    output: AudioFormat
    end_of_turn: Literal["silence", "smart-turn", "input_end"] = Field(
        "silence", description="how this session's turns end, as in force: after a silence, by the end-of-turn "
                               "model, or only at input.end (vad false)")
    eagerness: Eagerness | None = Field(
        None, description="smart-turn's eagerness in force; null for the other rules")
    voice: str | None = Field(
        None, description="the voice this session chose (session.start voice); null: each reply's language picks")


class SpeechStarted(_ServerEvent):
    """VAD found speech at ``audio_ms`` (position in the session's input stream, ms)."""

    type: Literal["speech.started"] = "speech.started"
    turn_id: TurnId
    audio_ms: int


class SpeechStopped(_ServerEvent):
    """The turn's speech ended at ``audio_ms``."""

    type: Literal["speech.stopped"] = "speech.stopped"
    turn_id: TurnId
    audio_ms: int
    reason: Literal["silence", "max_length", "input_end", "restart", "end_of_turn"]


class TranscriptPartial(_ServerEvent):
    """The transcript so far: ``committed`` never changes, ``unstable`` may."""

    type: Literal["transcript.partial"] = "transcript.partial"
    turn_id: TurnId
    committed: str
    unstable: str
    text: str
    language: str | None


TranscriptSource = Literal["asr", "partial"]
"""Where a final transcript's words come from: ``asr``, the final decode of the whole
utterance; ``partial``, only the words the partial transcripts had committed (a refused
turn whose final decode the ASR stage had no room for: its last words may be missing)."""


class TranscriptFinal(_ServerEvent):
    """The turn's transcript; ``audio_ms`` is the utterance's length. A turn refused at its
    end (``busy``, sent first) still gets one, ``unanswered``: no reply follows, and the
    conversation history keeps its words as the user's (so the next reply knows them).
    Speech that began as a turn of its own over an audible reply and then continued the
    earlier turn (see docs/PROTOCOL.md, "Talking over a reply") has ``continues_turn_id``:
    its transcript is the whole utterance — the only word of the join when the reply had
    already been all sent, so no ``response.cancelled`` came."""

    type: Literal["transcript.final"] = "transcript.final"
    turn_id: TurnId
    text: str
    language: str | None
    audio_ms: int
    unanswered: bool = Field(
        default=False, description="the turn was refused (its busy came first): no reply follows; the history keeps "
                                   "it as the user's words")
    source: TranscriptSource = Field(
        default="asr", description="asr: the final decode of the utterance; partial: only the words the partial "
                                   "transcripts had committed (its last words may be missing)")
    continues_turn_id: TurnId | None = Field(
        default=None, description="the earlier turn this speech continued after its reply was heard (a new turn_id "
                                  "that joined it): this transcript holds both; show it in that turn's place")


class TurnEmpty(_ServerEvent):
    """A turn (or ``input.end``) produced no words: no reply follows."""

    type: Literal["turn.empty"] = "turn.empty"
    turn_id: TurnId
    reason: Literal["no_speech", "no_words", "backchannel", "echo", "restart"] = Field(
        description="backchannel: only an acknowledgement (\"yeah\", \"mm-hm\") spoken over a reply, which goes "
                    "on; echo: the reply's own words, heard back through the client's microphone")


class ResponseStarted(_ServerEvent):
    """A reply begins."""

    type: Literal["response.started"] = "response.started"
    response_id: int
    user_text: str
    voice: str | None = Field(
        None, description="the voice that speaks the reply (null: the server does not say: a remote TTS)")


class ResponseTextDelta(_ServerEvent):
    """Reply text as the LLM writes it (markdown kept)."""

    type: Literal["response.text.delta"] = "response.text.delta"
    response_id: int
    delta: str


class ResponseDone(_ServerEvent):
    """The reply is complete. ``timings_ms``: see docs/PROTOCOL.md."""

    type: Literal["response.done"] = "response.done"
    response_id: int
    text: str
    fallback: bool = Field(description="the model said nothing speakable, or the LLM was unavailable, and a stock "
                                       "line was spoken")
    text_only: bool = Field(default=False, description="some or all of the reply has no audio: the TTS stage's "
                                                       "circuit breaker was open, or it failed (tts_failed)")
    finish_reason: Literal["stop", "length", "abort", "error"]
    output_tokens: int
    audio_s: float
    timings_ms: dict[str, float]
    voice: str | None = Field(None, description="the voice that spoke the reply, as in response.started")


class ToolCallEvent(_ServerEvent):
    """The model called a tool while making reply ``response_id``: the server runs it
    (``runs_on: "server"``, its ``tool.output`` follows) or waits for the client's
    ``tool.result`` (``runs_on: "client"``)."""

    type: Literal["tool.call"] = "tool.call"
    response_id: int
    call_id: str
    name: str
    arguments: dict[str, Any] = Field(description="checked against the tool's JSON Schema")
    runs_on: Literal["server", "client"]


class ToolOutput(_ServerEvent):
    """A call's result as the model gets it: the server's tool's, or the client's
    ``tool.result``; ``error`` when it failed (it raised, timed out, never answered)."""

    type: Literal["tool.output"] = "tool.output"
    response_id: int
    call_id: str
    name: str
    output: str
    error: str | None = None
    ms: float = Field(ge=0, description="how long the call took (ms)")


CancelReason = Literal["client", "barge_in", "continued", "new_turn", "restart", "error"]


class ResponseCancelled(_ServerEvent):
    """The reply was stopped; ``spoken_text`` is what was sent for playback."""

    type: Literal["response.cancelled"] = "response.cancelled"
    response_id: int
    spoken_text: str
    reason: CancelReason


PauseReason = Literal["speech"]


class ResponsePaused(_ServerEvent):
    """The reply's audio stopped, the rest kept: the user speaks over it (a possible
    barge-in). ``response.resumed`` (no words, or only a backchannel) or
    ``response.cancelled`` follows."""

    type: Literal["response.paused"] = "response.paused"
    response_id: int
    reason: PauseReason


class ResponseResumed(_ServerEvent):
    """A paused reply goes on from where it stopped (it was a false interruption)."""

    type: Literal["response.resumed"] = "response.resumed"
    response_id: int
    paused_ms: int = Field(ge=0, description="how long it was paused (ms)")


class Busy(_ServerEvent):
    """A turn was refused before any work was spent on its reply: try again after
    ``retry_after_ms``. A spoken turn refused at its end keeps its words: its
    ``transcript.final`` (``unanswered``) follows unless it had none."""

    type: Literal["busy"] = "busy"
    turn_id: TurnId
    reason: BusyReason
    retry_after_ms: int = Field(ge=0, description="when a retry may succeed (ms)")
    message: str


class ServerStatus(_ServerEvent):
    """The server's service level changed: ``degraded`` while any condition is in force
    (out-of-memory ladder step, circuit breaker not closed, SLO adaptation). Sent to every
    session on each change, and right after ``session.started`` when degraded."""

    type: Literal["server.status"] = "server.status"
    degraded: bool
    conditions: list[Condition]


ErrorCode = Literal["bad_json", "unknown_type", "bad_event", "no_session", "bad_audio", "asr_failed",
                    "tts_failed", "reply_failed", "not_ready", "rate_limited", "idle_timeout", "internal"]


class Error(_ServerEvent):
    """Something went wrong; ``fatal``: the server closes the connection."""

    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    fatal: bool = False


ServerEvent = Annotated[SessionStarted | SpeechStarted | SpeechStopped | TranscriptPartial | TranscriptFinal | TurnEmpty
                        | ResponseStarted | ResponseTextDelta | ResponseDone | ResponseCancelled | ResponsePaused
                        | ResponseResumed | ToolCallEvent | ToolOutput | Busy | ServerStatus | Error,
                        Field(discriminator="type")]
"""Any server → client event."""

SERVER_EVENTS: tuple[type[BaseModel], ...] = (
    SessionStarted, SpeechStarted, SpeechStopped, TranscriptPartial, TranscriptFinal, TurnEmpty,
    ResponseStarted, ResponseTextDelta, ResponseDone, ResponseCancelled, ResponsePaused, ResponseResumed,
    ToolCallEvent, ToolOutput, Busy, ServerStatus, Error,
)


def event_type(cls: type[BaseModel]) -> str:
    """The ``type`` string of an event class (e.g. ``"session.start"``)."""
    return str(cls.model_fields["type"].annotation.__args__[0])  # type: ignore[union-attr]
