"""Barge-in decisions: speech over the assistant's reply pauses, cancels or leaves it
(pure, no I/O; times in ms on the caller's clock).

Speech that starts while a reply is current is a barge-in *candidate*. With false-interruption
resume on (``TurnConfig.resume_after_ms`` > 0) and the reply audible, the candidate first
PAUSES it. Words cancel it: a partial transcript with words that are not a backchannel
(:mod:`pipeline.session.backchannel`; with ``backchannels`` off every word counts) once the
speech lasted ``barge_in_min_ms``, or a final transcript with such words. No words, or only a
backchannel, RESUMES it: when the speech ends and nothing more will be decoded (the turn was
refused), when the final transcript says so, or ``resume_after_ms`` after the pause whatever
the speech is doing then (noise that goes on). This is the scheme of LiveKit Agents'
``resume_false_interruption`` / ``false_interruption_timeout`` (docs.livekit.io, "Turn
handling options"), with the word rule deciding instead of a fixed word count.

With ``resume_after_ms`` 0 and ``backchannels`` off it decides as voxpipe always did: any
partial with words after ``barge_in_min_ms`` cancels, and nothing is ever paused.
"""

from __future__ import annotations

from pipeline.config import TurnConfig
from pipeline.session.backchannel import Backchannels, Heard, words
from pipeline.session.types import BargeAction

A = BargeAction


class BargeIn:
    """One session's barge-in state.

    Args:
        cfg: ``barge_in_min_ms``, ``resume_after_ms``.
        backchannels: the backchannel rule (None: ``backchannels`` off, every word counts).

    Attributes:
        candidate: the speech in progress is over a reply that it has not cancelled.
        speaking: speech is in progress (over a reply or not).
        heard: what the candidate's latest partial said.
        paused_at: when the reply was paused (ms), None while it is not.
    """

    def __init__(self, cfg: TurnConfig, backchannels: Backchannels | None) -> None:
        self.min_ms, self.resume_ms = float(cfg.barge_in_min_ms), float(cfg.resume_after_ms)
        self.backchannels = backchannels
        self.candidate = False
        self.speaking = False
        self.heard: Heard = "nothing"
        self.paused_at: float | None = None

    @property
    def on(self) -> bool:
        """The new policy is on (backchannels or resume): without it nothing here differs from
        a plain "words cancel" rule."""
        return self.backchannels is not None or self.resume_ms > 0

    @property
    def paused(self) -> bool:
        """The reply is paused."""
        return self.paused_at is not None

    def classify(self, text: str, speech_ms: float, language: str | None = None) -> Heard:
        """``nothing``, ``backchannel`` (only with the rule on) or ``words``."""
        if self.backchannels is not None:
            return self.backchannels.heard(text, speech_ms, language)
        return "words" if words(text) else "nothing"

    def speech_started(self, now_ms: float, *, replying: bool, audible: bool) -> BargeAction:
        """Speech began; ``replying``: over a current reply, ``audible``: whose audio has
        started. PAUSE when it should stop for now (once: a reply already paused stays so)."""
        self.speaking, self.candidate, self.heard = True, replying, "nothing"
        if replying and audible and self.resume_ms > 0 and self.paused_at is None:
            self.paused_at = now_ms
            return A.PAUSE
        return A.NONE

    def partial(self, text: str, speech_ms: float, language: str | None = None, *,
                voiced_ms: float | None = None) -> BargeAction:
        """A partial transcript ``text`` of the speech in progress (``speech_ms`` long so far):
        CANCEL on words (not a backchannel) once the speech lasted ``barge_in_min_ms``. A
        backchannel's length limit applies to ``voiced_ms`` (the speech up to its last voiced
        window; None: ``speech_ms``): a partial often comes a second after a "yeah" ended."""
        if not self.candidate:
            return A.NONE
        self.heard = self.classify(text, speech_ms if voiced_ms is None else voiced_ms, language)
        if self.heard == "words" and speech_ms >= self.min_ms:
            self.candidate, self.paused_at = False, None
            return A.CANCEL
        return A.NONE

    def due(self, now_ms: float) -> BargeAction:
        """The pause timer: RESUME once ``resume_after_ms`` passed since the pause with no
        words heard."""
        if self.paused_at is not None and now_ms - self.paused_at >= self.resume_ms and self.heard != "words":
            self.paused_at = None
            return A.RESUME
        return A.NONE

    def speech_ended(self, *, submitted: bool) -> BargeAction:
        """The speech ended; ``submitted``: its final transcript will decide (else RESUME now:
        nothing more will be heard of it)."""
        self.speaking = self.candidate = False
        if self.paused_at is not None and not submitted:
            self.paused_at = None
            return A.RESUME
        return A.NONE

    def final(self, text: str, speech_ms: float, language: str | None = None) -> tuple[Heard, BargeAction]:
        """The final transcript of a speech turn that was spoken over a reply (``speech_ms``:
        its speech's length): what it said, and CANCEL (words, while paused), RESUME (no
        words or a backchannel, while paused and no other speech is in progress: that one
        decides) or NONE."""
        heard = self.classify(text, speech_ms, language)
        if self.paused_at is None:
            return heard, A.NONE
        if heard == "words":
            self.paused_at = None
            return heard, A.CANCEL
        if self.speaking:
            return heard, A.NONE
        self.paused_at = None
        return heard, A.RESUME

    def forget_pause(self) -> None:
        """The paused reply ended some other way (cancelled, a new turn): nothing to resume."""
        self.paused_at = None
