"""The conversation's turn state machine (pure, no I/O).

listening → user speaking → thinking → speaking → listening. Speech that starts while
the assistant is thinking or speaking is a barge-in *candidate*: the reply goes on
until the session confirms real words (then :meth:`TurnState.barge_in`) or the burst
ends without them (a cough, a clap: :meth:`TurnState.speech_stopped` returns to the
reply's state).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    THINKING = "thinking"
    SPEAKING = "speaking"


class TurnState:
    """Tracks whose turn it is. Every method returns the new :class:`Phase`."""

    def __init__(self) -> None:
        self.phase = Phase.LISTENING
        self.replying = False  # a reply is in progress (thinking or speaking)
        self.reply_audible = False  # its audio has started
        self.interrupting = False  # the user speaks over a reply (unconfirmed)

    def speech_started(self) -> Phase:
        self.interrupting = self.replying
        self.phase = Phase.USER_SPEAKING
        return self.phase

    def speech_stopped(self, *, turn_submitted: bool) -> Phase:
        """The user's speech ended; ``turn_submitted``: it went to ASR as a turn."""
        self.interrupting = False
        if turn_submitted:
            self.phase = Phase.THINKING
        else:
            self.phase = self._reply_phase()
        return self.phase

    def barge_in(self) -> Phase:
        """Confirmed: the user talks over the reply, which is cancelled."""
        self.replying = self.reply_audible = self.interrupting = False
        self.phase = Phase.USER_SPEAKING
        return self.phase

    def reply_started(self) -> Phase:
        self.replying, self.reply_audible = True, False
        if self.phase is not Phase.USER_SPEAKING:
            self.phase = Phase.THINKING
        return self.phase

    def audio_started(self) -> Phase:
        self.reply_audible = True
        if self.phase is Phase.THINKING:
            self.phase = Phase.SPEAKING
        return self.phase

    def reply_ended(self) -> Phase:
        """The reply finished or was cancelled."""
        self.replying = self.reply_audible = self.interrupting = False
        if self.phase is not Phase.USER_SPEAKING:
            self.phase = Phase.LISTENING
        return self.phase

    def turn_empty(self) -> Phase:
        """A submitted turn had no words: back to the reply (if any) or listening."""
        if self.phase is Phase.THINKING and not self.replying:
            self.phase = Phase.LISTENING
        return self.phase

    def _reply_phase(self) -> Phase:
        if not self.replying:
            return Phase.LISTENING
        return Phase.SPEAKING if self.reply_audible else Phase.THINKING
