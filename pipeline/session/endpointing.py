"""VAD-based endpointing: speech probabilities per 32 ms window → turn boundaries.

A pure synchronous class (no I/O). The hysteresis (start at ``threshold``, keep
speaking until below ``neg_threshold``) follows Silero VAD's ``get_speech_timestamps``
(https://github.com/snakers4/silero-vad), made incremental.
"""

from __future__ import annotations

import numpy as np

from audio.pcm import RATE
from audio.vad import WINDOW
from pipeline.config import TurnConfig
from pipeline.session.end_of_turn import Decision, EndOfTurnPolicy
from pipeline.session.types import (
    EndReason,
    SpeechCheck,
    SpeechEnd,
    SpeechPause,
    SpeechResume,
    SpeechStart,
    TurnEvent,
)


class Endpointer:
    """Turn a stream of VAD probabilities into :class:`SpeechStart` / :class:`SpeechEnd`.

    Speech starts on the first window at or above ``threshold`` and is confirmed once
    ``min_speech_ms`` of it has passed (a shorter burst is forgotten); the turn ends
    after ``end_silence_ms`` of windows below ``neg_threshold``, or at ``max_turn_s``.
    After ``early_end_ms`` of such silence (when 0 < ``early_end_ms`` < ``end_silence_ms``)
    it emits :class:`SpeechPause`, and :class:`SpeechResume` if speech returns before
    the end.

    With a ``policy`` (the semantic end of turn, :mod:`pipeline.session.end_of_turn`) the
    silence does not end the turn by itself: at each of the policy's checkpoints the
    endpointer emits :class:`SpeechCheck` as the last event of :meth:`feed` and stops
    reading; audio fed meanwhile waits. :meth:`verdict` (the model's answer) applies the
    policy's decision — the turn ends (``end_of_turn``, or ``silence`` at the cap) or waits
    for the next checkpoint — and reads on.
    """

    def __init__(self, cfg: TurnConfig, policy: EndOfTurnPolicy | None = None) -> None:
        self.cfg = cfg
        self._ms_per_win = WINDOW * 1000 / RATE
        self._pos = 0  # samples seen
        self._start: int | None = None  # candidate/confirmed speech start
        self._confirmed = False
        self._speech_ms = 0.0
        self._silence_ms = 0.0
        self._last_speech_end = 0
        self._paused = False  # SpeechPause sent for the current silence
        early = cfg.early_end_ms
        self._early_ms = early if 0 < early < cfg.end_silence_ms else None
        self.policy = policy
        self._next_ms: float = policy.first_check_ms if policy is not None else 0.0  # next checkpoint
        self._next_asks = True  # ... asks the model (else: it ends the turn)
        self._waiting = False  # a SpeechCheck awaits its verdict
        self._backlog: list[float] = []  # windows fed while waiting

    @property
    def waiting(self) -> bool:
        """A :class:`SpeechCheck` was emitted and its :meth:`verdict` has not come."""
        return self._waiting

    @property
    def pending_start(self) -> int | None:
        """Start sample of speech being heard (confirmed or not yet), else None."""
        return self._start

    @property
    def last_speech_end(self) -> int:
        """Sample where the latest window with speech in it ended (the trailing silence of the
        speech in progress starts there)."""
        return self._last_speech_end

    @property
    def in_speech(self) -> bool:
        """True between a confirmed :class:`SpeechStart` and its :class:`SpeechEnd`."""
        return self._confirmed

    def feed(self, probs) -> list[TurnEvent]:
        """Consume probabilities of consecutive windows; return the events they cause (a
        :class:`SpeechCheck` comes last: the rest waits for :meth:`verdict`)."""
        if self._waiting:
            self._backlog.extend(probs)
            return []
        events: list[TurnEvent] = []
        c = self.cfg
        for i, p in enumerate(probs):
            win_start = self._pos
            self._pos += WINDOW
            if self._start is None:
                if p >= c.threshold:
                    self._start, self._speech_ms, self._silence_ms = win_start, self._ms_per_win, 0.0
                    self._last_speech_end = self._pos
                continue
            if p >= c.neg_threshold:
                self._speech_ms += self._ms_per_win
                self._silence_ms = 0.0
                self._last_speech_end = self._pos
                self._checkpoint(self.policy.first_check_ms if self.policy is not None else 0.0, True)
                if self._paused:
                    self._paused = False
                    events.append(SpeechResume(win_start))
            else:
                self._silence_ms += self._ms_per_win
            if not self._confirmed:
                if self._speech_ms >= c.min_speech_ms:
                    self._confirmed = True
                    events.append(SpeechStart(self._start))
                elif self._silence_ms >= c.end_silence_ms:
                    self._start = None  # a short burst: never speech
                    continue
            if self._confirmed:
                early = self._early_ms
                if early is not None and not self._paused and early <= self._silence_ms < c.end_silence_ms:
                    self._paused = True
                    events.append(SpeechPause(self._start, self._last_speech_end))
                if self.policy is not None and self._silence_ms > 0 and self._silence_ms >= self._next_ms:
                    if self._next_asks:
                        events.append(SpeechCheck(self._start, self._last_speech_end, self._pos, self._silence_ms))
                        self._waiting, self._backlog = True, [float(x) for x in probs[i + 1 :]]
                        return events
                    events.append(self._decided(self.policy.at_unasked(self._silence_ms)))
                elif self.policy is None and self._silence_ms >= c.end_silence_ms:
                    events.append(self._end("silence"))
                elif (self._pos - self._start) / RATE >= c.max_turn_s:
                    events.append(self._end("max_length", at=self._pos))
        return events

    def verdict(self, prob: float | None) -> list[TurnEvent]:
        """The answer to the pending :class:`SpeechCheck`: the model's probability that the
        turn is complete (None: no answer, the policy falls back to silence). Returns the
        events the decision and the audio fed meanwhile cause.

        Raises:
            RuntimeError: no :class:`SpeechCheck` is pending."""
        if not self._waiting or self.policy is None:
            raise RuntimeError("verdict without a pending SpeechCheck")
        self._waiting = False
        events: list[TurnEvent] = []
        decision = self.policy.decide(prob, self._silence_ms)
        if decision.end:
            events.append(self._decided(decision))
        else:
            self._checkpoint(decision.next_check_ms or 0.0, decision.ask)
        backlog, self._backlog = self._backlog, []
        return events + self.feed(backlog)

    def _checkpoint(self, silence_ms: float, asks: bool) -> None:
        self._next_ms, self._next_asks = silence_ms, asks

    def _decided(self, decision: Decision) -> SpeechEnd:
        """End the turn as the policy decided."""
        cause = decision.cause or "fallback"
        return self._end("end_of_turn" if cause == "model" else "silence", cause=cause)

    def finish(self) -> SpeechEnd | None:
        """The client said the turn is over (``input.end``): end the current speech now.

        Returns the :class:`SpeechEnd` if speech was confirmed, else None (an
        unconfirmed burst is forgotten).
        """
        # the session answers every SpeechCheck before it reads on, so none is pending here;
        # if one were, the client's end of input decides instead of the model
        self._waiting, self._backlog = False, []
        if not self._confirmed:
            self._start = None
            return None
        return self._end("input_end")

    def _end(self, reason: EndReason, at: int | None = None, cause: str = "") -> SpeechEnd:
        end = self._last_speech_end if at is None else at
        ev = SpeechEnd(self._start or 0, end, reason, cause or reason)
        self._start, self._confirmed, self._paused = None, False, False
        self._speech_ms = self._silence_ms = 0.0
        self._checkpoint(self.policy.first_check_ms if self.policy is not None else 0.0, True)
        return ev


class AllSpeech:
    """Stands in for a VAD stream when a session turns VAD off (``"vad": false``):
    every 32 ms window counts as speech, so a turn runs from the first audio until
    ``input.end`` or ``max_turn_s``."""

    def __init__(self) -> None:
        self._pending = 0

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Consume 16 kHz samples, shape (n,); return 1.0 per completed window (float32, (k,))."""
        n = self._pending + len(samples)
        self._pending = n % WINDOW
        return np.ones(n // WINDOW, dtype=np.float32)
