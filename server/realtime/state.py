"""What a ``/v1/realtime`` outbox remembers: the user items of voxpipe turns, the Realtime
responses of voxpipe replies, the client function calls waiting for an output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.session import events as ev


@dataclass(slots=True)
class ReplyState:
    """A voxpipe reply as Realtime responses: one, or one per client function call (each
    call ends a response; the reply goes on in the next, server/realtime/calls.py)."""

    id: str  # the Realtime response now reporting the reply
    item_id: str | None = None  # its assistant message (made with the first text or audio)
    audio_bytes: int = 0
    text: str = ""  # text of this Realtime response
    before: str = ""  # text of the earlier Realtime responses of this reply
    output: list[dict[str, Any]] = field(default_factory=list)  # this response's items done so far
    held: list[ev.ServerEvent | bytes] | None = None  # parked (None: open): what waits for the next response


@dataclass(slots=True)
class TurnState:
    """A voxpipe user turn as a Realtime user item."""

    item_id: str
    committed: bool = False
    sent: str = ""  # transcription text sent as deltas (append-only)


@dataclass
class OutboxState:
    """What a Realtime outbox remembers of its connection."""

    turns: dict[int, TurnState] = field(default_factory=dict)
    replies: dict[int, ReplyState] = field(default_factory=dict)
    last_item: str | None = None  # the latest item in the conversation (previous_item_id)
    open_turn: int | None = None  # the turn whose speech is in progress
    created: bool = False  # session.created was sent
    calls: set[str] = field(default_factory=set)  # client function calls announced, waiting for their output
    quiet_start: int = 0  # session.started events to swallow (a restart for input_audio_buffer.clear)
