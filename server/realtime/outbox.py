"""The session's events → Realtime server events: an outbox that speaks the Realtime API.

The :class:`~pipeline.session.session.Session` sends voxpipe events (``speech.started``,
``transcript.partial``, ``response.started``, ...) and reply audio to its outbox; this
one translates each into the Realtime events it stands for, in the connection's dialect
(GA or beta names), with OpenAI-style ids (``event_…``, ``item_…``, ``resp_…``), and
queues them on the WebSocket like :class:`~server.outbox.WsOutbox` (same back-pressure,
same slow-client rule). The mapping is docs/REALTIME.md's table.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from pipeline.session import events as ev

from ..outbox import WsOutbox
from . import calls
from .state import OutboxState, ReplyState, TurnState
from .types import Settings, new_id

__all__ = ["RealtimeOutbox", "new_id", "user_item"]

CLIENT_ERRORS = frozenset({"bad_json", "unknown_type", "bad_event", "no_session", "bad_audio", "rate_limited"})
"""voxpipe error codes that are the client's doing: Realtime ``invalid_request_error``
(the others are ``server_error``)."""

KEEP_TURNS = 64
"""User items remembered per connection (the latest turns'; a session's turns are only ever
continued right after they end)."""

GA_TO_BETA = {
    "conversation.item.added": "conversation.item.created",
    "response.output_audio.delta": "response.audio.delta",
    "response.output_audio.done": "response.audio.done",
    "response.output_audio_transcript.delta": "response.audio_transcript.delta",
    "response.output_audio_transcript.done": "response.audio_transcript.done",
}
"""Event names that differ between the GA Realtime API (keys) and the beta one (values);
``conversation.item.done`` is GA only."""

FINISH_STATUS: dict[str, tuple[str, dict[str, Any] | None]] = {
    "length": ("incomplete", {"type": "incomplete", "reason": "max_output_tokens"}),
    "error": ("failed", {"type": "failed", "error": {"type": "server_error", "code": "reply_failed"}}),
    "abort": ("cancelled", {"type": "cancelled", "reason": "turn_detected"}),
}
"""voxpipe's ``response.done`` ``finish_reason`` → Realtime response ``status`` and
``status_details`` (``stop``: ``completed``)."""

CANCEL_REASONS = {"client": "client_cancelled"}
"""voxpipe's ``response.cancelled`` reason → Realtime ``status_details.reason``; every
other reason (barge-in, the user went on, a new turn, restart) is ``turn_detected``."""


class RealtimeOutbox(WsOutbox):
    """Outbox translating session events into Realtime events on a websockets connection.

    Args:
        ws: the ``/v1/realtime`` connection.
        settings: the connection's settings (shared with the client-event side, which
            updates them).
        maxsize, timeout_s: as :class:`~server.outbox.WsOutbox`.
    """

    def __init__(self, ws, settings: Settings, *, maxsize: int, timeout_s: float) -> None:
        super().__init__(ws, maxsize=maxsize, timeout_s=timeout_s)
        self.settings = settings
        self.st = OutboxState()
        self.session_object: dict[str, Any] = {}  # the session.created / session.updated payload (set by the wire)

    # ---- the Outbox protocol --------------------------------------------------------

    async def send(self, event: ev.ServerEvent) -> None:
        if calls.hold(self, event):
            return
        handler = getattr(self, "_on_" + event.type.replace(".", "_"), None)
        if handler is not None:
            await handler(event)

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        r = self.st.replies.get(response_id)
        if r is None:
            return
        if r.held is not None:  # between a function call and the next response.create
            r.held.append(pcm16)
            return
        item_id = await self.message(r)
        r.audio_bytes += len(pcm16)
        await self.emit("response.output_audio.delta", response_id=r.id, item_id=item_id, output_index=0,
                        content_index=0, delta=base64.b64encode(pcm16).decode("ascii"))

    @property
    def active(self) -> bool:
        """Whether a Realtime response is in progress (a reply parked after a function call
        is not: its response is done)."""
        return any(r.held is None for r in self.st.replies.values())

    async def resume(self) -> bool:
        """``response.create`` after a function call: the parked reply goes on as a new
        Realtime response. False when no reply is parked."""
        return await calls.resume(self)

    # ---- sending ----------------------------------------------------------------------

    async def emit(self, kind: str, **fields: Any) -> None:
        """Send one Realtime event named ``kind`` (its GA name; renamed for a beta
        connection) with a fresh ``event_id``."""
        if self.settings.dialect == "beta":
            kind = GA_TO_BETA.get(kind, kind)
        await self._put(json.dumps({"type": kind, "event_id": new_id("event"), **fields}, ensure_ascii=False))

    async def error(self, code: str, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                    event_id: str | None = None, **extra: Any) -> None:
        """Send an ``error`` event: ``{type: "error", event_id, error: {type, code,
        message, param, event_id}}`` (``event_id`` inside: the client event it is about)."""
        await self.emit("error", error={"type": kind, "code": code, "message": message, "param": param,
                                        "event_id": event_id, **extra})

    async def session_event(self) -> None:
        """``session.created`` the first time, ``session.updated`` after."""
        kind = "session.updated" if self.st.created else "session.created"
        self.st.created = True
        await self.emit(kind, session=self.session_object)

    def turn(self, turn_id: int) -> TurnState:
        """The user item of voxpipe turn ``turn_id`` (made on first use)."""
        t = self.st.turns.get(turn_id)
        if t is None:
            t = self.st.turns[turn_id] = TurnState(new_id("item"))
            if len(self.st.turns) > KEEP_TURNS:  # turn ids count up: the oldest is first
                del self.st.turns[next(iter(self.st.turns))]
        return t

    async def commit(self, turn_id: int) -> str:
        """Report turn ``turn_id``'s audio committed as a user item (once):
        ``input_audio_buffer.committed`` + ``conversation.item.added``. Returns its id."""
        t = self.turn(turn_id)
        if not t.committed:
            t.committed = True
            await self.emit("input_audio_buffer.committed", item_id=t.item_id, previous_item_id=self.st.last_item)
            await self.item_added(user_item(t.item_id, "input_audio", None, status="completed"))
        return t.item_id

    async def item_added(self, item: dict[str, Any]) -> None:
        """A conversation item joins the conversation."""
        await self.emit("conversation.item.added", previous_item_id=self.st.last_item, item=item)
        self.st.last_item = item["id"]

    # ---- voxpipe events -----------------------------------------------------------------

    async def _on_session_started(self, e: ev.SessionStarted) -> None:
        if self.st.quiet_start:
            self.st.quiet_start -= 1
            return
        await self.session_event()

    async def _on_speech_started(self, e: ev.SpeechStarted) -> None:
        self.st.open_turn = e.turn_id
        t = self.turn(e.turn_id)
        if self.settings.server_vad:
            await self.emit("input_audio_buffer.speech_started", audio_start_ms=e.audio_ms, item_id=t.item_id)

    async def _on_speech_stopped(self, e: ev.SpeechStopped) -> None:
        self.st.open_turn = None
        if e.reason == "restart":  # input_audio_buffer.clear, or a session.update that restarted the input
            return
        if self.settings.server_vad and e.reason != "input_end":
            await self.emit("input_audio_buffer.speech_stopped", audio_end_ms=e.audio_ms,
                            item_id=self.turn(e.turn_id).item_id)
        await self.commit(e.turn_id)

    async def _on_transcript_partial(self, e: ev.TranscriptPartial) -> None:
        # deltas are append-only: only the committed (stable) prefix is sent as it grows
        await self._transcript_delta(e.turn_id, e.committed)

    async def _transcript_delta(self, turn_id: int, text: str) -> None:
        t = self.turn(turn_id)
        if text.startswith(t.sent) and len(text) > len(t.sent):
            delta, t.sent = text[len(t.sent):], text
            await self.emit("conversation.item.input_audio_transcription.delta", item_id=t.item_id,
                            content_index=0, delta=delta)

    async def _on_transcript_final(self, e: ev.TranscriptFinal) -> None:
        await self._transcript_delta(e.turn_id, e.text)
        await self._completed(e.turn_id, e.text, e.audio_ms)

    async def _completed(self, turn_id: int, text: str, audio_ms: int) -> None:
        await self.emit("conversation.item.input_audio_transcription.completed", item_id=self.turn(turn_id).item_id,
                        content_index=0, transcript=text, usage={"type": "duration", "seconds": audio_ms / 1000})

    async def _on_turn_empty(self, e: ev.TurnEmpty) -> None:
        if e.reason in ("no_words", "backchannel", "echo"):  # a backchannel over a reply is no turn of its own
            await self._completed(e.turn_id, "", 0)
        elif e.reason == "no_speech":
            await self.error("input_audio_buffer_commit_empty", "the input audio buffer holds no speech to commit")

    async def _on_response_started(self, e: ev.ResponseStarted) -> None:
        for rid in [rid for rid, r in self.st.replies.items() if r.held is not None]:
            del self.st.replies[rid]  # a parked reply the session has moved on from
        r = self.st.replies[e.response_id] = ReplyState(new_id("resp"))
        await self.emit("response.created", response=self.response(r, "in_progress"))  # its message: with its text

    async def message(self, r: ReplyState) -> str:
        """The id of ``r``'s assistant message in its current Realtime response, made (and
        reported: ``response.output_item.added``, ``conversation.item.added``,
        ``response.content_part.added``) on first use."""
        if r.item_id is None:
            r.item_id = new_id("item")
            item = assistant_item(r.item_id, "", self.settings, status="in_progress")
            await self.emit("response.output_item.added", response_id=r.id, output_index=len(r.output), item=item)
            await self.item_added(item)
            await self.emit("response.content_part.added", response_id=r.id, item_id=r.item_id,
                            output_index=len(r.output), content_index=0, part=audio_part("", self.settings))
        return r.item_id

    async def _on_response_text_delta(self, e: ev.ResponseTextDelta) -> None:
        r = self.st.replies.get(e.response_id)
        if r is not None:
            r.text += e.delta
            await self.emit("response.output_audio_transcript.delta", response_id=r.id, item_id=await self.message(r),
                            output_index=0, content_index=0, delta=e.delta)

    async def _on_response_done(self, e: ev.ResponseDone) -> None:
        status, details = FINISH_STATUS.get(e.finish_reason, ("completed", None))
        await self._finish(e.response_id, e.text, status, details, usage={"output_tokens": e.output_tokens})

    async def _on_response_cancelled(self, e: ev.ResponseCancelled) -> None:
        r = self.st.replies.get(e.response_id)
        if r is not None and r.held is not None:  # its Realtime response is done already
            del self.st.replies[e.response_id]
            return
        await self._finish(e.response_id, e.spoken_text, "cancelled",
                           {"type": "cancelled", "reason": CANCEL_REASONS.get(e.reason, "turn_detected")})

    async def _finish(self, rid: int, text: str, status: str, details: dict | None,
                      usage: dict[str, int] | None = None) -> None:
        r = self.st.replies.pop(rid, None)
        if r is None:
            return
        if r.before:  # a response after a function call reports its own part of the reply
            text = text[len(r.before):].lstrip() if text.startswith(r.before) else r.text
        item = await self.close_message(r, text, "completed" if status == "completed" else "incomplete")
        await self.emit("response.done", response=self.response(r, status, details, [*r.output, item], usage))

    async def close_message(self, r: ReplyState, text: str, status: str) -> dict[str, Any]:
        """End ``r``'s assistant message (made now if it was not) with transcript ``text``:
        the ``….done`` events; returns the item."""
        item_id = await self.message(r)
        common = {"response_id": r.id, "item_id": item_id, "output_index": 0}
        await self.emit("response.output_audio.done", **common, content_index=0)
        await self.emit("response.output_audio_transcript.done", **common, content_index=0, transcript=text)
        await self.emit("response.content_part.done", **common, content_index=0, part=audio_part(text, self.settings))
        item = assistant_item(item_id, text, self.settings, status=status)
        await self.emit("response.output_item.done", response_id=r.id, output_index=0, item=item)
        if self.settings.dialect == "ga":
            await self.emit("conversation.item.done", item=item)
        return item

    async def _on_tool_call(self, e: ev.ToolCallEvent) -> None:
        await calls.on_tool_call(self, e)

    async def _on_tool_output(self, e: ev.ToolOutput) -> None:
        await calls.on_tool_output(self, e)

    async def _on_busy(self, e: ev.Busy) -> None:
        # a refused turn: an error (code server_busy), and a response that failed at once
        message = f"{e.message} (busy: {e.reason}; retry after {e.retry_after_ms} ms)"
        await self.error("server_busy", message, kind="server_error", retry_after_ms=e.retry_after_ms)
        r = ReplyState(new_id("resp"))
        await self.emit("response.created", response=self.response(r, "in_progress"))
        details = {"type": "failed", "error": {"type": "server_error", "code": "server_busy", "message": message}}
        await self.emit("response.done", response=self.response(r, "failed", details))

    async def _on_error(self, e: ev.Error) -> None:
        await self.error(e.code, e.message, kind="invalid_request_error" if e.code in CLIENT_ERRORS else "server_error")

    # ---- shapes ---------------------------------------------------------------------------

    def response(self, r: ReplyState, status: str, details: dict | None = None, output: list | None = None,
                 usage: dict[str, int] | None = None) -> dict[str, Any]:
        """A Realtime response object."""
        modalities = "modalities" if self.settings.dialect == "beta" else "output_modalities"
        return {"id": r.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output or [], "conversation_id": "conv_voxpipe", modalities: ["audio"], "usage": usage}


def user_item(item_id: str, kind: str, text: str | None, *, status: str) -> dict[str, Any]:
    """A user message item with one content part: ``input_audio`` (``text``: its
    transcript, None while unknown) or ``input_text``."""
    part = {"type": kind, "transcript": text} if kind == "input_audio" else {"type": kind, "text": text}
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": status,
            "content": [part]}


def assistant_item(item_id: str, transcript: str, settings: Settings, *, status: str) -> dict[str, Any]:
    """An assistant message item with one audio part (its transcript)."""
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
            "content": [audio_part(transcript, settings)]}


def audio_part(transcript: str, settings: Settings) -> dict[str, Any]:
    """An assistant audio content part (``output_audio``; ``audio`` in the beta dialect)."""
    return {"type": "audio" if settings.dialect == "beta" else "output_audio", "transcript": transcript}
