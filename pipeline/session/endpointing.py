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
from pipeline.session.types import EndReason, SpeechEnd, SpeechPause, SpeechResume, SpeechStart, TurnEvent


class Endpointer:
    """Turn a stream of VAD probabilities into :class:`SpeechStart` / :class:`SpeechEnd`.

    Speech starts on the first window at or above ``threshold`` and is confirmed once
    ``min_speech_ms`` of it has passed (a shorter burst is forgotten); the turn ends
    after ``end_silence_ms`` of windows below ``neg_threshold``, or at ``max_turn_s``.
    After ``early_end_ms`` of such silence (when 0 < ``early_end_ms`` < ``end_silence_ms``)
    it emits :class:`SpeechPause`, and :class:`SpeechResume` if speech returns before
    the end.
    """

    def __init__(self, cfg: TurnConfig) -> None:
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

    @property
    def pending_start(self) -> int | None:
        """Start sample of speech being heard (confirmed or not yet), else None."""
        return self._start

    @property
    def in_speech(self) -> bool:
        """True between a confirmed :class:`SpeechStart` and its :class:`SpeechEnd`."""
        return self._confirmed

    def feed(self, probs) -> list[TurnEvent]:
        """Consume probabilities of consecutive windows; return the events they cause."""
        events: list[TurnEvent] = []
        c = self.cfg
        for p in probs:
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
                if self._silence_ms >= c.end_silence_ms:
                    events.append(self._end("silence"))
                elif (self._pos - self._start) / RATE >= c.max_turn_s:
                    events.append(self._end("max_length", at=self._pos))
        return events

    def finish(self) -> SpeechEnd | None:
        """The client said the turn is over (``input.end``): end the current speech now.

        Returns the :class:`SpeechEnd` if speech was confirmed, else None (an
        unconfirmed burst is forgotten).
        """
        if not self._confirmed:
            self._start = None
            return None
        return self._end("input_end")

    def _end(self, reason: EndReason, at: int | None = None) -> SpeechEnd:
        end = self._last_speech_end if at is None else at
        ev = SpeechEnd(self._start or 0, end, reason)
        self._start, self._confirmed, self._paused = None, False, False
        self._speech_ms = self._silence_ms = 0.0
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
