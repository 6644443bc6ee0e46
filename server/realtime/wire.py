"""Realtime client events → :class:`~pipeline.session.session.Session` calls: the
``/v1/realtime`` side of :meth:`server.app.VoxpipeServer.handle` (which reads, paces and
budgets the frames; this parses and acts on them). docs/REALTIME.md is the reference.

Manual turns (``turn_detection: null``): ``input_audio_buffer.commit`` reports the audio
committed; ``response.create`` ends the voxpipe turn (``input.end``), which transcribes and
answers it. Audio appended between the two is held and fed after, as the next turn.

Function calling: ``session.update`` ``tools`` are the session's client tools; a
``function_call_output`` item is the client's ``tool.result``; ``response.create`` after a
function call goes on with the parked reply (server/realtime/calls.py).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from pydantic import TypeAdapter, ValidationError

from pipeline.config import VoxpipeConfig
from pipeline.session.events import SessionStart
from pipeline.session.session import Session
from server.protocol import json_kind

from . import calls
from .config import dialect_of, read_update, session_choice, session_object
from .outbox import RealtimeOutbox, new_id, user_item
from .types import (
    CLIENT_TYPES,
    REALTIME_RATE,
    AudioAppend,
    AudioClear,
    AudioCommit,
    ClientEvent,
    Dialect,
    ItemCreate,
    OutputItem,
    RealtimeError,
    ResponseCancel,
    ResponseCreate,
    SessionUpdate,
)

_ADAPTER: TypeAdapter = TypeAdapter(ClientEvent)

Feed = Callable[[bytes], Awaitable[None]]
"""Hands PCM16 24 kHz bytes to the session through the client's audio budget."""
Pace = Callable[[int], Awaitable[bool]]
"""Waits as the client's text-frame budget says for a frame of that many bytes; False: the
frame is dropped."""


def dialect_from_headers(headers) -> Dialect:
    """``beta`` when the upgrade request has ``OpenAI-Beta: realtime=v1`` (the ``openai``
    package's ``client.beta.realtime`` sends it), else ``ga``."""
    return "beta" if "realtime=v1" in (headers.get("OpenAI-Beta") or "").replace(" ", "") else "ga"


def parse_event(text: str):
    """One text frame → a Realtime client event of :data:`~server.realtime.types.ClientEvent`.

    Raises:
        RealtimeError: ``invalid_json`` (not a JSON object), ``invalid_value`` (unknown or
            unsupported ``type``, param ``type``; a field's value, e.g. bad base64),
            ``invalid_event`` (fields missing or of the wrong type; param: the first field
            at fault).
    """
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise RealtimeError("invalid_json", f"the frame is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(raw, dict):
        raise RealtimeError("invalid_json", f"an event must be a JSON object, got {json_kind(raw)}")
    if "\\u" in text:  # only an escape can make a lone surrogate ("\ud800"): JSON, but not text
        try:
            json.dumps(raw, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise RealtimeError("invalid_json", "the frame is not valid Unicode text (a lone surrogate such as "
                                "\\ud800)") from None
    kind, event_id = raw.get("type"), raw.get("event_id") if isinstance(raw.get("event_id"), str) else None
    if kind not in CLIENT_TYPES:
        shown = repr(kind) if len(repr(kind)) <= 64 else repr(kind)[:60] + "...'"
        raise RealtimeError("invalid_value", f"unsupported event type {shown}; voxpipe supports {list(CLIENT_TYPES)} "
                            "(docs/REALTIME.md)", param="type", event_id=event_id)
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"][1:])) or None
        code = "invalid_value" if first["type"] == "value_error" else "invalid_event"
        raise RealtimeError(code, f"invalid {kind}: {where or 'event'}: {first['msg']}", param=where,
                            event_id=event_id) from None


class RealtimeWire:
    """One ``/v1/realtime`` connection's client side.

    Args:
        out: the connection's outbox (it shares ``out.settings``).
        session: the connection's session.
        cfg: the server's configuration (default system prompt, turn settings).
    """

    def __init__(self, out: RealtimeOutbox, session: Session, cfg: VoxpipeConfig) -> None:
        self.out, self.session, self.cfg = out, session, cfg
        self.settings = out.settings
        self._dialect_fixed = self.settings.dialect == "beta"  # the header decided it
        self._pending_commit = False  # manual mode: committed, waiting for response.create
        self._held: list[bytes] = []  # manual mode: audio appended after that commit
        self._appended = 0  # bytes appended since the last commit
        self._texts: list[str] = []  # user text items waiting for response.create

    async def open(self) -> None:
        """Start the session (PCM16 24 kHz both ways, server VAD): ``session.created``.
        A client's function call gets no filler ("One moment."): the reply goes on only
        after ``response.create``, when the filler would come too late."""
        self.session.tools.client_filler = False
        self._refresh()
        await self.session.start(self._start_event())

    async def frame(self, frame: str | bytes, feed: Feed, pace: Pace) -> None:
        """Act on one frame; a bad one gets an ``error`` event and changes nothing.
        ``input_audio_buffer.append`` is paced by ``feed`` (the audio budget), every
        other frame by ``pace`` (the text-frame budget) first."""
        event_id = None
        try:
            if isinstance(frame, bytes):
                if await pace(len(frame)):
                    raise RealtimeError("invalid_frame", "binary frames are not part of the Realtime API: send "
                                        "audio as input_audio_buffer.append (base64 PCM16, 24 kHz)")
                return
            try:
                e = parse_event(frame)
            except RealtimeError:
                if await pace(len(frame)):
                    raise
                return
            event_id = e.event_id
            if isinstance(e, AudioAppend):
                await self._append(e, feed)
            elif await pace(len(frame)):
                await self._act(e, feed)
        except RealtimeError as exc:
            await self.out.error(exc.code, str(exc), param=exc.param, event_id=exc.event_id or event_id)

    async def _act(self, e, feed: Feed) -> None:
        if isinstance(e, SessionUpdate):
            await self._update(e)
        elif isinstance(e, AudioCommit):
            await self._commit(feed)
        elif isinstance(e, AudioClear):
            await self._clear()
        elif isinstance(e, ItemCreate):
            await self._item(e)
        elif isinstance(e, ResponseCreate):
            await self._respond(feed)
        elif isinstance(e, ResponseCancel):
            if not self.out.active:
                raise RealtimeError("response_cancel_not_active", "there is no response in progress to cancel")
            await self.session.cancel_response()

    # ---- events -----------------------------------------------------------------------

    async def _append(self, e: AudioAppend, feed: Feed) -> None:
        pcm = e.pcm
        self._appended += len(pcm)
        if self._pending_commit:
            self._held.append(pcm)
        else:
            await feed(pcm)

    async def _update(self, e: SessionUpdate) -> None:
        new = read_update(e.session, self.settings)
        if new.tools != self.settings.tools:
            try:
                self.session.tools.declare(new.tools)
            except ValueError as exc:
                raise RealtimeError("invalid_value", str(exc), param="session.tools") from None
        if new.voice != self.settings.voice:
            param = "session.voice" if "voice" in e.session else "session.audio.output.voice"
            try:
                self.session.choose_voice(new.voice)
            except ValueError as exc:  # UnknownVoice: the message lists the server's voices
                raise RealtimeError("invalid_value", str(exc), param=param) from None
        self.session.tools.choice = session_choice(new)
        self.settings.tools, self.settings.tool_choice = new.tools, new.tool_choice
        self.settings.voice = new.voice
        if not self._dialect_fixed:
            new.dialect = dialect_of(e.session) or self.settings.dialect
            self._dialect_fixed = dialect_of(e.session) is not None
        turns = (new.server_vad, new.end_of_turn, new.eagerness)
        restart = turns != (self.settings.server_vad, self.settings.end_of_turn, self.settings.eagerness)
        self.settings.instructions, self.settings.server_vad = new.instructions, new.server_vad
        self.settings.end_of_turn, self.settings.eagerness = new.end_of_turn, new.eagerness
        self.settings.dialect = new.dialect
        self._refresh()
        if restart:  # VAD on/off, its end of turn: a new turn tracker; the session.started it sends is session.updated
            self._pending_commit, self._held = False, []
            await self.session.start(self._start_event())
        else:
            await self.out.session_event()

    async def _commit(self, feed: Feed) -> None:
        turn = self.out.st.open_turn
        if turn is None or (not self.settings.server_vad and not self._appended):
            raise RealtimeError("input_audio_buffer_commit_empty", "the input audio buffer holds no speech to commit")
        if self.settings.server_vad:  # ends the speech now; the reply follows (input.end)
            await self.session.end_input()
            return
        self._appended = 0
        if self._pending_commit:  # a second commit before response.create: one turn with the first
            held, self._held = self._held, []
            for pcm in held:
                await feed(pcm)
        self._pending_commit = True
        again = self.out.turn(turn).committed
        item_id = await self.out.commit(turn)  # input_audio_buffer.committed + conversation.item.added
        if again:
            await self.out.emit("input_audio_buffer.committed", item_id=item_id, previous_item_id=None)

    async def _clear(self) -> None:
        self._appended, self._held = 0, []
        if self.out.st.open_turn is not None and not self._pending_commit:
            self.out.st.quiet_start += 1  # a restart of the input, not a new session
            await self.session.start(self._start_event())
        await self.out.emit("input_audio_buffer.cleared")

    async def _item(self, e: ItemCreate) -> None:
        if isinstance(e.item, OutputItem):
            await self._output(e.item, e.event_id)
            return
        texts = [p.text for p in e.item.content if p.type == "input_text" and p.text]
        if not texts or len(texts) != len(e.item.content):
            raise RealtimeError("invalid_value", "voxpipe accepts user messages of input_text parts only",
                                param="item.content", event_id=e.event_id)
        self._texts.append("\n".join(texts))
        await self.out.item_added(user_item(e.item.id or new_id("item"), "input_text", "\n".join(texts),
                                            status="completed"))

    async def _output(self, item: OutputItem, event_id: str | None) -> None:
        """A function call's output: recorded as an item, handed to the waiting call."""
        if not calls.waiting(self.out, item.call_id) or not self.session.tools.waiting(item.call_id):
            raise RealtimeError("invalid_value", f"no function call {item.call_id[:64]!r} waits for an output "
                                "(unknown, answered already, or timed out)", param="item.call_id",
                                event_id=event_id)
        self.out.st.calls.discard(item.call_id)
        recorded = calls.function_call_output_item(item.id or new_id("item"), item.call_id, item.output)
        await self.out.item_added(recorded)
        if self.settings.dialect == "ga":
            await self.out.emit("conversation.item.done", item=recorded)
        await self.session.tool_result(item.call_id, item.output)

    async def _respond(self, feed: Feed) -> None:
        if await self.out.resume():  # the reply that called a function goes on
            return
        if self._texts:
            text, self._texts = "\n".join(self._texts), []
            await self.session.text_input(text)
        elif self._pending_commit:
            self._pending_commit = False
            held, self._held = self._held, []
            await self.session.end_input()
            for pcm in held:
                await feed(pcm)
        else:
            raise RealtimeError("response_create_without_input", "voxpipe answers user input: commit audio "
                                "(turn_detection null) or create a user message first; with server_vad, "
                                "speech is answered when it ends")

    # ---- helpers ----------------------------------------------------------------------

    def _refresh(self) -> None:
        """Apply the instructions and recompute the session object."""
        prompt = self.settings.instructions or self.cfg.llm.system_prompt
        self.session.history.system_prompt = prompt
        self.out.session_object = session_object(self.settings, self.cfg, self.session.id, prompt)

    def _start_event(self) -> SessionStart:
        return SessionStart(type="session.start", sample_rate=REALTIME_RATE, format="pcm16", channels=1,
                            output_sample_rate=REALTIME_RATE, output_format="pcm16", system_prompt=None, language=None,
                            vad=self.settings.server_vad, end_of_turn=self.settings.end_of_turn,
                            eagerness=self.settings.eagerness, tools=list(self.settings.tools),
                            voice=self.settings.voice)
