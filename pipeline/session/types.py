"""Types of the session room: the outbox every sender uses, the turn events of the turn
tracker (16 kHz sample indices in the session's input stream), and the stages and events of
the turn runner's state machine (:mod:`pipeline.session.turn_machine`)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pipeline.session.events import ServerEvent


class Outbox(Protocol):
    """Where a session sends events and reply audio (the server implements it over the
    WebSocket; :class:`~pipeline.session.speculation.HeldOutbox` holds a speculation's).

    ``send`` and ``audio`` may wait for room (back-pressure from a slow client) and may
    raise the transport's error when the client is gone or too slow.
    """

    async def send(self, event: ServerEvent) -> None:
        """Send one server event."""
        ...

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        """Send reply audio: PCM16 mono bytes at the session's output rate."""
        ...


@dataclass(slots=True, frozen=True)
class TurnHooks:
    """What a reply tells admission about its turn (each optional).

    Attributes:
        on_submit: called once its LLM request was queued (or refused).
        on_first_audio: called with its voice-to-voice time (ms) once its first audio
            frame went out.
        on_end: called once it ended, however (done, cancelled, failed): a turn cancelled
            before its first audio must not keep holding its place.
    """

    on_submit: Callable[[], None] | None = None
    on_first_audio: Callable[[float], None] | None = None
    on_end: Callable[[], None] | None = None


@dataclass(slots=True, frozen=True)
class SpeechStart:
    """Speech began at ``sample`` (16 kHz sample index in the session's stream)."""

    sample: int


@dataclass(slots=True, frozen=True)
class SpeechPause:
    """Confirmed speech has been silent for ``early_end_ms`` since sample ``end``: the
    turn may be ending (it ends for sure only at ``end_silence_ms``). Emitted once per
    silence; the session starts a speculative final transcript and reply here."""

    start: int
    end: int


@dataclass(slots=True, frozen=True)
class SpeechResume:
    """Speech came back after a :class:`SpeechPause`, before the turn ended."""

    sample: int


@dataclass(slots=True, frozen=True)
class SpeechCheck:
    """Confirmed speech has been silent for ``silence_ms`` since sample ``end``: with the
    semantic end of turn (``--end-of-turn smart-turn``) the endpointer asks whether the
    turn is complete and waits for the answer (:meth:`Endpointer.verdict
    <pipeline.session.endpointing.Endpointer.verdict>`) before it reads more audio.

    Attributes:
        start: the speech's first sample (16 kHz index in the session's stream).
        end: where the speech stopped (sample index).
        at: the sample up to which the endpointer has read (the turn's audio to judge ends
            here).
        silence_ms: silence so far (ms).
    """

    start: int
    end: int
    at: int
    silence_ms: float


EndReason = Literal["silence", "max_length", "input_end", "end_of_turn"]
"""Why speech ended, as ``speech.stopped`` says it: ``end_of_turn`` when the end-of-turn
model said the turn is complete."""


@dataclass(slots=True, frozen=True)
class SpeechEnd:
    """The turn ended: speech ran from ``start`` to ``end`` (16 kHz sample indices).

    ``reason`` is ``silence`` (end-of-speech silence), ``end_of_turn`` (the end-of-turn
    model said complete), ``max_length`` or ``input_end``; ``cause`` is the metric's finer
    label (:data:`~pipeline.session.end_of_turn.EotCause`: ``model``, ``cap``, ``fallback``, or the reason itself).
    """

    start: int
    end: int
    reason: EndReason
    cause: str = field(default="", compare=False)


TurnEvent = SpeechStart | SpeechPause | SpeechResume | SpeechCheck | SpeechEnd
"""What the endpointer (and the turn tracker) reports."""


class TurnStage(enum.Enum):
    """Where the latest speech turn stands between its speech and its reply (the state of
    :class:`~pipeline.session.turn_machine.TurnMachine`)."""

    IDLE = "idle"
    """No speech turn yet (or the session restarted)."""
    HEARING = "hearing"
    """Its speech is in progress, streamed to the ASR."""
    SPECULATING = "speculating"
    """Its speech paused: a speculative final decode and a held reply run."""
    REFUSED = "refused"
    """It ended and admission refused it (``busy``); speech that resumes within the merge
    window continues it, and it is decided again at its new end."""
    TRANSCRIBING = "transcribing"
    """It ended: its task decodes the final transcript, then starts the reply."""
    CONFIRMING = "confirming"
    """It ended where the speculation decoded it: its task makes that final and lets the
    held reply out (or falls back to a final decode)."""
    DONE = "done"
    """Its task ended: a reply started (the session's replies own it from here), or the
    turn had no words, or its transcription failed."""


class StageEvent(enum.Enum):
    """What moves a :class:`TurnStage` (see the table in :mod:`pipeline.session.turn_machine`)."""

    SPEECH = "speech"
    """Speech began that starts a new turn."""
    CONTINUE = "continue"
    """Speech began that continues the latest turn (the merge window)."""
    SPECULATE = "speculate"
    """The speech paused and a speculation started."""
    DROP = "drop"
    """The speculation was dropped (the speech resumed, a typed turn, a refusal, a restart)."""
    REFUSE = "refuse"
    """The speech ended and the turn was refused."""
    SUBMIT = "submit"
    """The speech ended and the turn was admitted: its task starts."""
    TASK_DONE = "task_done"
    """The task of the latest turn that ended finished (however)."""
    RESET = "reset"
    """``session.start`` again: the latest turn is forgotten."""
