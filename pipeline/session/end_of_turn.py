"""Semantic end of turn: when has the user finished? (pure, no I/O).

With ``--end-of-turn smart-turn`` the endpointer does not end a turn after a fixed silence.
Once the VAD has heard :data:`FIRST_CHECK_MS` of silence it asks an end-of-turn model
(Smart Turn v3.2, :mod:`pipeline.eot`) for the probability that the turn's audio so far is
a complete turn, and :class:`EndOfTurnPolicy` decides:

- a probability at or above the eagerness's ``complete`` threshold ends the turn at once
  (well before today's 500 ms of silence);
- below it, the turn waits: a thinking pause mid-sentence ("I'd like to book … a table")
  does not end it, up to the eagerness's ``cap_ms`` of silence, which ends it whatever the
  model says;
- no probability (the model's queue was full, or it failed) falls back to the silence rule
  (``end_silence_ms``), so a busy model never stalls a turn.

The model is asked once per silence, early. Smart Turn was trained on audio that ends a
short VAD stop after the speech (Pipecat runs it after 200 ms of VAD silence, its
``stop_secs``); Silero's speech probability itself trails the real end of speech by a
window or more, so 100 ms of VAD silence gives the model about the silence it knows. On
sentences cut mid-way, the probability is low there but climbs, and grows noisy, as the
silence grows (docs/BENCHMARKS.md, "bench turns"): asking again later mostly ends thinking
pauses, so a "not yet" waits for the cap instead.

The eagerness names and their meaning (low waits longest, high answers soonest) are OpenAI
Realtime's ``semantic_vad`` ``eagerness``; 0.5 is Smart Turn's own decision threshold. The
caps are shorter than OpenAI's (2/4/8 s): a person waiting on a voice assistant notices 3 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

FIRST_CHECK_MS = 100
"""VAD silence after which the model is asked (ms)."""
EOT_WINDOW_S = 8.0
"""The end-of-turn model reads at most the turn's last 8 s (Smart Turn v3's input)."""
EOT_PRE_MS = 500
"""Audio before the speech start given to the model (ms; Pipecat's ``pre_speech_ms``)."""

EotCause = Literal["model", "cap", "fallback"]
"""Why a turn ended: the model said complete, the eagerness's silence cap, or the silence
rule because the model gave no answer."""


@dataclass(frozen=True, slots=True)
class Eagerness:
    """One eagerness setting.

    Attributes:
        complete: the model's probability at or above which the turn ends.
        cap_ms: silence that ends the turn whatever the model says (ms).
    """

    complete: float
    cap_ms: int


EAGERNESS: dict[str, Eagerness] = {
    "high": Eagerness(complete=0.3, cap_ms=1200),
    "medium": Eagerness(complete=0.5, cap_ms=2000),
    "low": Eagerness(complete=0.7, cap_ms=3000),
}
"""The settings by name; ``auto`` is ``medium`` (:func:`eagerness`)."""


def eagerness(name: str) -> Eagerness:
    """The :class:`Eagerness` called ``name`` (``auto`` → ``medium``).

    Raises:
        ValueError: an unknown name."""
    key = "medium" if name == "auto" else name
    if key not in EAGERNESS:
        raise ValueError(f"unknown eagerness {name!r}: auto, {', '.join(EAGERNESS)}")
    return EAGERNESS[key]


@dataclass(frozen=True, slots=True)
class Decision:
    """What the policy decided at a checkpoint.

    Attributes:
        end: the turn ends now.
        cause: why it ends (None while it waits).
        next_check_ms: while it waits, the silence (ms since the speech stopped) at which
            to decide again: the cap, or the fallback's silence (None once it ends).
        ask: whether that next checkpoint asks the model (only the first one does).
    """

    end: bool
    cause: EotCause | None = None
    next_check_ms: float | None = None
    ask: bool = True


class EndOfTurnPolicy:
    """Decide a turn's end from the end-of-turn model's probability and the silence.

    Args:
        setting: the session's :class:`Eagerness`.
        fallback_ms: the silence rule's ``end_silence_ms``, used when the model gives no
            answer.
    """

    def __init__(self, setting: Eagerness, *, fallback_ms: int) -> None:
        self.setting = setting
        self.fallback_ms = fallback_ms

    @property
    def first_check_ms(self) -> int:
        """Silence after which the model is first asked (ms)."""
        return FIRST_CHECK_MS

    def decide(self, prob: float | None, silence_ms: float) -> Decision:
        """Decide at a checkpoint ``silence_ms`` into the silence, with the model's
        probability that the turn is complete (None: no answer)."""
        s = self.setting
        if silence_ms >= s.cap_ms:
            return Decision(end=True, cause="cap")
        if prob is None or math.isnan(prob):
            if silence_ms >= self.fallback_ms:
                return Decision(end=True, cause="fallback")
            return Decision(end=False, next_check_ms=min(self.fallback_ms, s.cap_ms), ask=False)
        if prob >= s.complete:
            return Decision(end=True, cause="model")
        return Decision(end=False, next_check_ms=s.cap_ms, ask=False)

    def at_unasked(self, silence_ms: float) -> Decision:
        """Decide at a checkpoint that does not ask the model (the cap, or the fallback's
        silence)."""
        s = self.setting
        if silence_ms >= s.cap_ms:
            return Decision(end=True, cause="cap")
        return Decision(end=True, cause="fallback")
