"""Messages of the ASR stage: decode requests and results, whole-utterance requests,
and the streaming transcript a session sees (no model code here)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class DecodeRequest:
    """One streaming decode: transcribe ``audio``, continuing after ``prefix``.

    Attributes:
        audio: float32 samples at 16 kHz, shape (n,), at most 30 s − ``pad_s``.
        prefix: committed text spoken inside ``audio``; forced as the decoder prefix.
        prompt: committed text spoken before ``audio`` (context only).
        language: ISO code, or None to detect (multilingual models only).
        word_times: also return the start/end time of every word (one batched align).
        final: the end of the turn (False: the speech goes on after ``audio``).
        urgent: on a turn's critical path (its speech ended: a catch-up before the final
            decode); final requests are always urgent. The ASR stage serves urgent
            requests before partial updates (:meth:`AsrEngine.priority`).
        background: nobody waits for it (the final transcript of a turn that admission
            refused, still told to its client): served after urgent requests and partial
            updates alike.
    """

    audio: np.ndarray
    prefix: str = ""
    prompt: str = ""
    language: str | None = None
    word_times: bool = False
    final: bool = False
    urgent: bool = False
    background: bool = False


@dataclass(slots=True, frozen=True)
class TimedWord:
    """A word of prefix + continuation with times (s from the start of the request's audio)."""

    text: str
    start: float
    end: float


@dataclass(slots=True)
class DecodeResult:
    """The continuation of one :class:`DecodeRequest`.

    Attributes:
        text: the words after the prefix that passed the guards ("" if none).
        language: language decoded (ISO code).
        words: prefix + ``text`` as :class:`TimedWord` (only when ``word_times``).
        no_speech_prob: Whisper's no-speech probability (0..1).
        avg_logprob: mean log-probability of the generated tokens.
        dropped: why generated text was removed ("" when nothing was), for logs.
        window_s: encoder window (s); batch: requests decoded together; decode_ms: the
            batch's wall time (ms).
    """

    text: str
    language: str
    words: list[TimedWord] | None = None
    no_speech_prob: float = 0.0
    avg_logprob: float = 0.0
    dropped: str = ""
    window_s: float = 0.0
    batch: int = 1
    decode_ms: float = 0.0


@dataclass(slots=True)
class AsrRequest:
    """One whole utterance to transcribe offline.

    Attributes:
        audio: float32 samples at 16 kHz, shape (n,), any length.
        language: ISO code such as ``en``, or None to detect (multilingual models only).
    """

    audio: np.ndarray
    language: str | None = None


@dataclass(slots=True)
class Transcript:
    """The result of one utterance.

    Attributes:
        text: the kept words ("" when nothing passed the hallucination guards).
        language: the language decoded.
        audio_s: utterance length (s).
        decode_ms: time spent in the model (ms).
        dropped: texts of segments removed by the guards, for logs.
    """

    text: str
    language: str
    audio_s: float
    decode_ms: float
    dropped: list[str] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class Partial:
    """The transcript of a turn so far.

    Attributes:
        committed: words agreed on; never retracted.
        unstable: the latest hypothesis after the committed words (may change).
        text: ``committed`` and ``unstable`` as running text.
        final: True for the end-of-turn transcript (then ``unstable`` is "").
        language: ISO code decoded.
    """

    committed: str
    unstable: str
    text: str
    final: bool
    language: str
