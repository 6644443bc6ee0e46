"""Run a real :class:`~pipeline.session.session.Session` over fake stages from a script.

A script is a list of client actions (:class:`Start`, :class:`Audio`, :class:`InputEnd`,
:class:`Text`, :class:`Cancel`) and waits (:class:`WaitFor`, :class:`WaitUntil`,
:class:`Sleep`); :func:`run_session` plays it and returns what the client saw, in order:
server events (``pipeline.session.events`` classes) and :class:`AudioOut` frames.
Waits have generous deadlines and raise :class:`TimeoutError` naming what never came, so a
broken behaviour fails a test instead of hanging it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from audio.pcm import RATE
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.serving.admission import Admission
from pipeline.session import events as ev
from pipeline.session.session import Session
from tests.fakes import fake_engines, pcm16

DEADLINE_S = 10.0
"""Default wait deadline (s): generous, only a broken behaviour reaches it."""


@dataclass(slots=True, frozen=True)
class AudioOut:
    """A reply audio frame the client received: ``n_bytes`` of PCM16 for ``response_id``."""

    response_id: int
    n_bytes: int


Seen = ev.SessionStarted | ev.SpeechStarted | ev.SpeechStopped | ev.TranscriptPartial | ev.TranscriptFinal \
    | ev.TurnEmpty | ev.ResponseStarted | ev.ResponseTextDelta | ev.ResponseDone | ev.ResponseCancelled \
    | ev.ResponsePaused | ev.ResponseResumed \
    | ev.Error | AudioOut


class RecordingOutbox:
    """An :class:`~pipeline.session.types.Outbox` that records everything, in order."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self._changed = asyncio.Event()

    async def send(self, event: Seen) -> None:
        self._record(event)

    async def audio(self, response_id: int, pcm16: bytes) -> None:
        self._record(AudioOut(response_id, len(pcm16)))

    def events(self, kind: type | None = None) -> list[Seen]:
        """What was seen (only instances of ``kind`` if given)."""
        return [e for e in self.seen if kind is None or isinstance(e, kind)]

    async def wait(self, pred: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
        """Wait until ``pred()`` holds (checked after every event and every 10 ms).

        Raises:
            TimeoutError: it did not within ``timeout_s``.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not pred():
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"waited {timeout_s} s for {what}; saw {[type(e).__name__ for e in self.seen]}")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 0.01))
            except TimeoutError:
                pass

    def _record(self, event: Seen) -> None:
        self.seen.append(event)
        self._changed.set()


# ---- script actions -----------------------------------------------------------------------


@dataclass(slots=True)
class Start:
    """Send ``session.start`` (PCM16 mono 16 kHz unless told) and wait for ``session.started``."""

    vad: bool = True
    sample_rate: int = RATE
    system_prompt: str | None = None
    end_of_turn: str | None = None
    eagerness: str | None = None
    language: str | None = None


@dataclass(slots=True)
class Audio:
    """Send ``samples`` (float32 at 16 kHz) as PCM16 frames of ``frame_ms``; with
    ``pace`` > 0, sleep ``frame_ms / pace`` between frames (1.0 = real time), else send
    them back to back (yielding to the loop after each)."""

    samples: np.ndarray
    frame_ms: float = 20.0
    pace: float = 0.0


@dataclass(slots=True)
class InputEnd:
    """Send ``input.end``."""


@dataclass(slots=True)
class Text:
    """Send ``text.input``."""

    text: str


@dataclass(slots=True)
class Cancel:
    """Send ``response.cancel``."""


@dataclass(slots=True)
class WaitFor:
    """Wait until the client has seen ``count`` events of ``kind`` in all (optionally
    only those for which ``where(event)`` holds)."""

    kind: type
    count: int = 1
    where: Callable[[Seen], bool] | None = None
    timeout_s: float = DEADLINE_S


@dataclass(slots=True)
class WaitUntil:
    """Wait until ``pred()`` holds (e.g. a fake's state)."""

    pred: Callable[[], bool]
    what: str = "a condition"
    timeout_s: float = DEADLINE_S


@dataclass(slots=True)
class Sleep:
    """Let the session run for ``s`` seconds."""

    s: float


Action = Start | Audio | InputEnd | Text | Cancel | WaitFor | WaitUntil | Sleep


@dataclass(slots=True)
class Harness:
    """A session over fakes and its recording outbox; :meth:`play` runs script actions."""

    engines: Engines = field(default_factory=fake_engines)
    cfg: VoxpipeConfig = field(default_factory=VoxpipeConfig)
    out: RecordingOutbox = field(default_factory=RecordingOutbox)
    admission: Admission | None = None
    session: Session = field(init=False)

    def __post_init__(self) -> None:
        self.session = Session(engines=self.engines, cfg=self.cfg, out=self.out, session_id="test",
                               admission=self.admission)

    async def play(self, script: Sequence[Action]) -> list[Seen]:
        """Run ``script`` in order; returns everything seen so far."""
        for action in script:
            await self._do(action)
        return list(self.out.seen)

    async def _do(self, a: Action) -> None:
        s = self.session
        if isinstance(a, Start):
            n = len(self.out.events(ev.SessionStarted))
            await s.start(ev.SessionStart.model_validate(
                {"type": "session.start", "sample_rate": a.sample_rate, "vad": a.vad,
                 "system_prompt": a.system_prompt, "end_of_turn": a.end_of_turn, "eagerness": a.eagerness,
                 "language": a.language}))
            await self.out.wait(lambda: len(self.out.events(ev.SessionStarted)) > n, "session.started")
        elif isinstance(a, Audio):
            step = int(a.frame_ms * RATE / 1000)
            for i in range(0, len(a.samples), step):
                await s.on_audio(pcm16(a.samples[i : i + step]))
                await asyncio.sleep(a.frame_ms / 1000 / a.pace if a.pace > 0 else 0)
        elif isinstance(a, InputEnd):
            await s.end_input()
        elif isinstance(a, Text):
            await s.text_input(a.text)
        elif isinstance(a, Cancel):
            await s.cancel_response()
        elif isinstance(a, WaitFor):
            where = a.where or (lambda e: True)
            await self.out.wait(lambda: sum(1 for e in self.out.events(a.kind) if where(e)) >= a.count,
                                f"{a.count} x {a.kind.__name__}", a.timeout_s)
        elif isinstance(a, WaitUntil):
            await self.out.wait(a.pred, a.what, a.timeout_s)
        elif isinstance(a, Sleep):
            await asyncio.sleep(a.s)

    async def close(self) -> None:
        """Close the session (cancels its tasks)."""
        await self.session.close()


async def run_session(script: Sequence[Action], *, engines: Engines | None = None,
                      cfg: VoxpipeConfig | None = None) -> list[Seen]:
    """Play ``script`` against a fresh session over ``engines`` (fakes by default), close
    it, and return what the client saw, in order."""
    h = Harness(engines=engines or fake_engines(), cfg=cfg or VoxpipeConfig())
    try:
        return await h.play(script)
    finally:
        await h.close()


def types_of(seen: Sequence[Seen], *, audio: bool = False) -> list[str]:
    """The ``type`` of each event seen (``"audio"`` for frames, left out unless ``audio``)."""
    return [e.type if not isinstance(e, AudioOut) else "audio" for e in seen if audio or not isinstance(e, AudioOut)]
