"""The stage interfaces a session uses: VAD, ASR, LLM and TTS as ``typing.Protocol`` s.

:class:`~pipeline.engines.Engines` holds one of each. The in-process engines
(:class:`~audio.vad.SileroVad`, :class:`~pipeline.asr.engine.AsrEngine`,
:class:`~pipeline.llm.engine.LlmEngine`, :class:`~pipeline.tts.engine.TtsEngine`) implement
them; so do the fakes in ``tests/fakes.py``, and so could a remote stage (e.g. a Ray Serve
deployment behind a small client).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import numpy as np

from pipeline.asr.types import AsrRequest, DecodeRequest, DecodeResult, Transcript
from pipeline.llm.types import GenRequest, GenStats
from pipeline.serving.types import StageLoad
from pipeline.tools.types import ToolSpec
from pipeline.tts.types import Phrase, Speech


class VadStream(Protocol):
    """One session's VAD state."""

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Consume 16 kHz float32 samples, shape (n,); return the speech probability
        (0..1) of each 512-sample window they complete, float32 shape (k,), in order."""
        ...


class VadModel(Protocol):
    """A VAD shared by every session; each session gets its own :class:`VadStream`."""

    def stream(self) -> VadStream:
        """A fresh per-session stream."""
        ...


class Stage(Protocol):
    """What the process does with every model stage: start, stop, watch its load."""

    def load(self) -> StageLoad:
        """The stage's load now: one consistent snapshot, cheap to take (admission takes
        one per turn, on the event loop); fields that do not apply are 0."""
        ...

    def start(self) -> None:
        """Start the stage's workers (idempotent)."""
        ...

    def stop(self) -> None:
        """Stop the stage's workers."""
        ...


class AsrStage(Stage, Protocol):
    """Whisper: streaming decodes (:class:`DecodeRequest`) and whole utterances
    (:class:`AsrRequest`).

    ``run`` raises :class:`~pipeline.errors.Busy` when the queue is full, or the model's
    exception.
    """

    @property
    def multilingual(self) -> bool:
        """False for an English-only model (``language`` is then ignored)."""
        ...

    @property
    def languages(self) -> list[str]:
        """ISO codes the model decodes."""
        ...

    async def run(self, item: DecodeRequest | AsrRequest) -> DecodeResult | Transcript:
        """Decode one request: a :class:`DecodeResult` for a :class:`DecodeRequest`, a
        :class:`Transcript` for an :class:`AsrRequest`."""
        ...


class TextStream(Protocol):
    """A reply's text deltas (``async for delta in stream``); see
    :class:`~pipeline.llm.stream.TokenStream`. ``stats`` is complete once iteration ends;
    iteration raises the engine's exception if generation failed."""

    stats: GenStats

    def __aiter__(self) -> AsyncIterator[str]: ...

    async def __anext__(self) -> str: ...

    def abort(self) -> None:
        """Stop generating (thread-safe, idempotent)."""
        ...


class LlmStage(Stage, Protocol):
    """The continuously batched LLM."""

    def submit(self, req: GenRequest) -> TextStream:
        """Queue a request; returns its stream of text deltas.

        Raises:
            Busy: the stage's queue is full.
        """
        ...

    def count_tokens(self, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> int:
        """Prompt tokens of chat ``messages`` with ``tools`` offered (may be slow: call it off
        the event loop)."""
        ...

    def end_session(self, session: str) -> None:
        """``session`` ended: what the stage keeps for it (cached KV) may go (thread-safe)."""
        ...


class TtsStage(Stage, Protocol):
    """Text to speech, one phrase at a time."""

    async def run(self, item: str | Phrase, *, priority: int | None = None) -> Speech:
        """Synthesize one phrase (a :class:`Phrase` names its voice; a ``str``: the default
        voice); ``priority`` 0 for a reply's first phrase (a user waits
        for it: served first), 1 for later ones (their reply is already playing).

        Raises:
            Busy: the stage's queue is full; or the voice's exception
            (:class:`~pipeline.tts.catalogue.UnknownVoice` for a voice it has not loaded).
        """
        ...


class EotStage(Stage, Protocol):
    """The end-of-turn model (:mod:`pipeline.eot`): has the user finished their turn?"""

    async def run(self, item: np.ndarray) -> float:
        """The probability (0..1) that the turn whose audio ``item`` is (float32, shape (n,),
        16 kHz mono, from before the speech start to now; the last 8 s are used) is complete.
        Requests from any sessions are batched.

        Raises:
            pipeline.errors.Busy: the stage's queue is full (the caller falls back to silence).
        """
        ...

