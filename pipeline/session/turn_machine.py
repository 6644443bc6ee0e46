"""The turn runner's state machine (pure, no I/O): where the latest speech turn stands
between its speech and its reply.

Every transition is in :data:`TRANSITIONS`; an event the table does not allow in the
current stage raises :class:`InvalidTransition` and changes nothing.

=============================================  ==============  =============
from                                           event           to
=============================================  ==============  =============
IDLE, REFUSED, TRANSCRIBING, CONFIRMING, DONE  SPEECH          HEARING
REFUSED, TRANSCRIBING, CONFIRMING, DONE        CONTINUE        HEARING
HEARING                                        SPECULATE       SPECULATING
SPECULATING                                    DROP            HEARING
HEARING                                        REFUSE          REFUSED
HEARING                                        SUBMIT          TRANSCRIBING
SPECULATING                                    SUBMIT          CONFIRMING
TRANSCRIBING, CONFIRMING                       TASK_DONE       DONE
IDLE, HEARING, SPECULATING, REFUSED            TASK_DONE       (unchanged)
any                                            RESET           IDLE
=============================================  ==============  =============

``TASK_DONE`` in a stage that has no task of its own is the end of a task the latest turn
left behind: it was cancelled when the speech continued the turn, or it still ran when new
speech started (its reply, if any, then replaces the one before), or the session restarted.

:class:`~pipeline.session.turn_state.TurnState` is the other machine of a session: whose
turn it is (listening, user speaking, thinking, speaking), for barge-in and ``busy``. This
one is the runner's progress on the latest speech turn; the runner tells ``TurnState``
what happened at the same points.
"""

from __future__ import annotations

from pipeline.session.types import StageEvent, TurnStage

S, E = TurnStage, StageEvent

TRANSITIONS: dict[tuple[TurnStage, StageEvent], TurnStage] = {
    **{(s, E.SPEECH): S.HEARING for s in (S.IDLE, S.REFUSED, S.TRANSCRIBING, S.CONFIRMING, S.DONE)},
    **{(s, E.CONTINUE): S.HEARING for s in (S.REFUSED, S.TRANSCRIBING, S.CONFIRMING, S.DONE)},
    (S.HEARING, E.SPECULATE): S.SPECULATING,
    (S.SPECULATING, E.DROP): S.HEARING,
    (S.HEARING, E.REFUSE): S.REFUSED,
    (S.HEARING, E.SUBMIT): S.TRANSCRIBING,
    (S.SPECULATING, E.SUBMIT): S.CONFIRMING,
    (S.TRANSCRIBING, E.TASK_DONE): S.DONE,
    (S.CONFIRMING, E.TASK_DONE): S.DONE,
    **{(s, E.TASK_DONE): s for s in (S.IDLE, S.HEARING, S.SPECULATING, S.REFUSED)},
    **{(s, E.RESET): S.IDLE for s in S},
}
"""(stage, event) → the next stage; a pair not in it is an invalid transition."""


class InvalidTransition(RuntimeError):
    """An event the current stage does not allow (a bug in the caller: nothing changed).

    Attributes:
        stage: the stage it arrived in.
        event: the event.
    """

    def __init__(self, stage: TurnStage, event: StageEvent) -> None:
        super().__init__(f"turn machine: {event.name} is not allowed in {stage.name}")
        self.stage, self.event = stage, event


class TurnMachine:
    """The latest speech turn's :class:`TurnStage`, moved only by :meth:`fire`.

    Attributes:
        stage: the current stage (``IDLE`` at first).
    """

    def __init__(self) -> None:
        self.stage = TurnStage.IDLE

    def fire(self, event: StageEvent) -> TurnStage:
        """Apply ``event``; returns the new stage.

        Raises:
            InvalidTransition: :data:`TRANSITIONS` has no such move from the current stage
                (the stage is left as it was).
        """
        nxt = TRANSITIONS.get((self.stage, event))
        if nxt is None:
            raise InvalidTransition(self.stage, event)
        self.stage = nxt
        return nxt

    @property
    def hearing(self) -> bool:
        """The turn's speech is in progress (speculating or not)."""
        return self.stage in (TurnStage.HEARING, TurnStage.SPECULATING)

    @property
    def speculating(self) -> bool:
        """A speculation of the speech in progress runs."""
        return self.stage is TurnStage.SPECULATING

    @property
    def refused(self) -> bool:
        """The turn ended refused: continuing it has no task or reply of its own to cancel."""
        return self.stage is TurnStage.REFUSED

    def may_speculate(self, *, busy: bool) -> bool:
        """A pause in the speech may start a speculative final transcript and reply: the
        speech is in progress with no speculation yet, and nothing else is in progress
        (``busy``: :attr:`TurnState.busy`, a turn being transcribed or answered)."""
        return self.stage is TurnStage.HEARING and not busy
