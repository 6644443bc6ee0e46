"""Turn ids and the merge window of one session (pure, no I/O).

Every turn has an id (:data:`~pipeline.session.events.TurnId`), per session, in the order
turns begin: a speech turn when its speech starts, a typed turn (``text.input``) or an
``input.end`` without speech when it arrives. Speech that resumes soon after the latest
speech turn ended continues that turn and keeps its id (``TurnConfig.merge_window_ms``),
so a pause mid-thought gets one reply.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable

from audio.pcm import RATE
from pipeline.config import TurnConfig
from pipeline.session.types import SpeechEnd

MERGE_DETECT_SLACK_S = 1.0
"""Clock slack of the merge window: speech is detected a little after it starts (the VAD's
minimum speech), so resumed speech is seen up to about this much later than it began."""


class TurnIds:
    """The turn ids of one session and the span of its latest speech turn.

    Args:
        cfg: ``merge_window_ms`` and ``max_turn_s``.
        clock: the time in seconds (``time.perf_counter``; the end times given to
            :meth:`speech_ended` are on this clock).

    Attributes:
        speech_id: the id of the latest speech turn (its partial transcripts carry it; 0
            before any).
        span: ``(start, end)`` of the latest speech turn, 16 kHz sample indices in the
            session's input stream (None before any, and after :meth:`reset`).
        end_t: when its speech ended (``clock()`` s; −inf before any).
        closed: the client ended it (``input.end``, push-to-talk): later speech never
            continues it.
    """

    def __init__(self, cfg: TurnConfig, clock: Callable[[], float] = time.perf_counter) -> None:
        self.cfg, self.clock = cfg, clock
        self.speech_id = 0
        self.span: tuple[int, int] | None = None
        self.end_t = -math.inf
        self.closed = False
        self._seq = 0  # the latest id given out
        self._ids: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()  # speech turns' ids

    def new(self) -> int:
        """A new turn's id (one more than the latest given out)."""
        self._seq += 1
        return self._seq

    def of(self, turn: object) -> int:
        """The id :meth:`register` gave speech turn ``turn`` (else the latest speech turn's)."""
        return self._ids.get(turn, self.speech_id)

    def register(self, turn: object, turn_id: int) -> None:
        """Speech turn ``turn`` (any object that takes a weak reference) has id ``turn_id``."""
        self._ids[turn] = turn_id

    def continues(self, start: int) -> bool:
        """Speech starting at sample ``start`` continues the latest speech turn: it resumed
        within ``merge_window_ms`` of its end — in the audio and on the clock (a client that
        stopped sending while it waited for the reply resumes close in audio, long after in
        time: a new turn) — the client did not close it, and the merged turn would stay well
        under ``max_turn_s``."""
        last, t = self.span, self.cfg
        window_s = t.merge_window_ms / 1000
        return (last is not None and not self.closed
                and start - last[1] <= window_s * RATE
                and self.clock() - self.end_t <= window_s + MERGE_DETECT_SLACK_S
                and (start - last[0]) / RATE < t.max_turn_s * 0.8)

    def speech_started(self, start: int, *, continues: bool) -> int:
        """Speech began at sample ``start``; ``continues``: it continues the latest speech
        turn (:meth:`continues`). Returns its turn's id: the latest speech turn's, or a new
        one (whose span then begins at ``start``)."""
        if not continues:
            self.speech_id = self.new()
            self.span = (start, start)
        return self.speech_id

    def speech_ended(self, end: SpeechEnd, t_end: float) -> None:
        """The speech in progress ended (``t_end``: when, on :attr:`clock`); a turn the
        client ended (``input_end``) is never continued by later speech."""
        start = self.span[0] if self.span else end.start
        self.span, self.end_t = (start, end.end), t_end
        self.closed = end.reason == "input_end"

    def rejoin(self, start: int) -> None:
        """The speech in progress joined an earlier speech turn that began at sample
        ``start``: the latest turn's span begins there (its id stays)."""
        if self.span is not None:
            self.span = (start, self.span[1])

    def close(self) -> None:
        """The client ended the latest turn (``input.end``): later speech starts a new one."""
        self.closed = True

    def reset(self) -> None:
        """``session.start`` again: no speech turn is continued any more."""
        self.span = None
