"""The conversation's turn state machine (pure, no I/O).

listening → user speaking → thinking → speaking → listening. Speech that starts while
the assistant is thinking or speaking is a barge-in *candidate*: the reply goes on
until the session confirms real words (then :meth:`TurnState.barge_in`) or the burst
ends without them (a cough, a clap: :meth:`TurnState.speech_stopped` returns to the
reply's state).

The session reads it to decide: :attr:`TurnState.interrupting` (may partial transcripts
cancel the reply: barge-in) and :attr:`TurnState.busy` (is a turn being answered:
``input.end`` without speech then reports nothing, and a pause in the speech starts no
speculative reply). Where the latest speech turn stands on its way to a reply is the turn
runner's own machine (:mod:`pipeline.session.turn_machine`).
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    """Whose turn it is."""

    LISTENING = "listening"
    USER_SPEAKING = "user_speaking"
    THINKING = "thinking"
    SPEAKING = "speaking"


class TurnState:
    """Tracks whose turn it is. Every transition returns the new :class:`Phase`.

    Attributes:
        phase: the current :class:`Phase`.
        replying: a reply is current (thinking or speaking).
        reply_audible: its audio has started.
        interrupting: the user speaks over a reply (not yet confirmed as a barge-in).
        awaiting_transcript: a turn went to ASR and its final transcript is not done.
    """

    def __init__(self) -> None:
        self.phase = Phase.LISTENING
        self.replying = False
        self.reply_audible = False
        self.interrupting = False
        self.awaiting_transcript = False

    @property
    def busy(self) -> bool:
        """A turn is being transcribed or answered."""
        return self.awaiting_transcript or self.replying

    def speech_started(self) -> Phase:
        """Confirmed speech began (over a reply: a barge-in candidate)."""
        self.interrupting = self.replying
        self.phase = Phase.USER_SPEAKING
        return self.phase

    def speech_stopped(self, *, turn_submitted: bool) -> Phase:
        """The user's speech ended; ``turn_submitted``: it went to ASR as a turn."""
        self.interrupting = False
        if turn_submitted:
            self.awaiting_transcript = True
            self.phase = Phase.THINKING
        else:
            self.phase = self._reply_phase()
        return self.phase

    def barge_in(self) -> Phase:
        """Confirmed: the user talks over the reply, which is cancelled."""
        self.replying = self.reply_audible = self.interrupting = False
        self.phase = Phase.USER_SPEAKING
        return self.phase

    def transcript_done(self) -> Phase:
        """The latest submitted turn's final transcription ended (with words, without, or
        failed, or abandoned because the speech went on)."""
        self.awaiting_transcript = False
        if self.phase is Phase.THINKING and not self.replying:
            self.phase = Phase.LISTENING
        return self.phase

    def reply_started(self) -> Phase:
        """A reply became current."""
        self.replying, self.reply_audible = True, False
        if self.phase is not Phase.USER_SPEAKING:
            self.phase = Phase.THINKING
        return self.phase

    def audio_started(self) -> Phase:
        """The current reply's first audio was sent."""
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
