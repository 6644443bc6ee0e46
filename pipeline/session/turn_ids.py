"""Turn ids and the merge window of one session (pure, no I/O).

Every turn has an id (:data:`~pipeline.session.events.TurnId`), per session, in the order
turns begin: a speech turn when its speech starts, a typed turn (``text.input``) or an
``input.end`` without speech when it arrives. Speech that resumes soon after the latest
speech turn ended continues that turn and keeps its id (``TurnConfig.merge_window_ms``),
so a pause mid-thought gets one reply.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

from audio.pcm import RATE
from pipeline.config import TurnConfig
from pipeline.session.types import SpeechEnd

MERGE_CLOCK_SLACK_S = 3.0
"""How much longer the gap before resumed speech may be on the client's clock than in the
audio (s): the time between the frames that brought the latest turn's end and the resumed
speech, less the audio between them. A client that stopped sending while it waited for the
reply resumes close in the audio, many seconds later: a new turn. A client on two busy
cores may send a few seconds late; a server that reads frames late does not count (see
:class:`TurnIds`)."""


class TurnIds:
    """The turn ids of one session and the span of its latest speech turn.

    Args:
        cfg: ``merge_window_ms`` and ``max_turn_s``.
        arrival: when the frame that brought sample N (16 kHz, the session's input
            stream) came, in seconds on the client's clock: a clock that runs at least while
            the server waits for the client's next frame and, in the server, only then
            (:attr:`Session.client_clock`), so a loaded server that reads frames late does
            not make the client look late.

    Attributes:
        speech_id: the id of the latest speech turn (its partial transcripts carry it; 0
            before any).
        span: ``(start, end)`` of the latest speech turn, 16 kHz sample indices in the
            session's input stream (None before any, and after :meth:`reset`).
        end_t: when the frame with its end came (``arrival``; −inf before any).
        closed: the client ended it (``input.end``, push-to-talk): later speech never
            continues it.
    """

    def __init__(self, cfg: TurnConfig, arrival: Callable[[int], float]) -> None:
        self.cfg, self.arrival = cfg, arrival
        self.speech_id = 0
        self.span: tuple[int, int] | None = None
        self.end_t = -math.inf
        self.closed = False
        self._seq = 0  # the latest id given out
        self._ids: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()  # speech turns' ids
        self._joined: dict[int, int] = {}  # a turn's id -> the earlier turn's it continued (join)

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

    def join(self, turn: object, turn_id: int) -> None:
        """Speech turn ``turn`` goes on under ``turn_id``, a later turn's id that continued it
        after all (:meth:`joined_to` gives ``turn``'s id so far for that id)."""
        earlier = self.of(turn)
        if earlier != turn_id:
            self._joined[turn_id] = earlier
        self.register(turn, turn_id)

    def joined_to(self, turn_id: int) -> int | None:
        """The id of the earlier turn that turn ``turn_id`` joined (:meth:`join`), else None."""
        return self._joined.get(turn_id)

    def continues(self, start: int) -> bool:
        """Speech starting at sample ``start`` continues the latest speech turn: it resumed
        within ``merge_window_ms`` of its end in the audio, and on the client's clock no
        more than :data:`MERGE_CLOCK_SLACK_S` later than in the audio (a client that stopped sending
        while it waited for the reply resumes close in the audio, long after in time: a new
        turn); the client did not close it, and the merged turn would stay well under
        ``max_turn_s``."""
        last, t = self.span, self.cfg
        if last is None or self.closed:
            return False
        audio_gap_s = (start - last[1]) / RATE
        return (audio_gap_s <= t.merge_window_ms / 1000
                and self.arrival(start) - self.end_t - audio_gap_s <= MERGE_CLOCK_SLACK_S
                and (start - last[0]) / RATE < t.max_turn_s * 0.8)

    def gaps(self, start: int) -> tuple[float, float]:
        """The gap (s) between the latest speech turn's end and speech starting at sample
        ``start``, in the audio and on the client's clock (for logs; ``(inf, inf)`` before
        any)."""
        if self.span is None:
            return math.inf, math.inf
        return (start - self.span[1]) / RATE, self.arrival(start) - self.end_t

    def speech_started(self, start: int, *, continues: bool) -> int:
        """Speech began at sample ``start``; ``continues``: it continues the latest speech
        turn (:meth:`continues`). Returns its turn's id: the latest speech turn's, or a new
        one (whose span then begins at ``start``)."""
        if not continues:
            self.speech_id = self.new()
            self.span = (start, start)
        return self.speech_id

    def speech_ended(self, end: SpeechEnd) -> None:
        """The speech in progress ended; a turn the client ended (``input_end``) is never
        continued by later speech."""
        start = self.span[0] if self.span else end.start
        self.span, self.end_t = (start, end.end), self.arrival(end.end)
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
