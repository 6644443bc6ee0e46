"""Fake model stages with scripted outputs and timings (no models, no threads).

They implement the interfaces of :mod:`pipeline.stages`, so a real
:class:`~pipeline.session.session.Session` runs over them (see ``tests/session_harness.py``).
Scripted audio drives them: a *tone* (amplitude ≥ :data:`WORD_LEVEL`) is speech with
words, quiet *noise* (0 < amplitude < :data:`WORD_LEVEL`) is speech without words (a
cough, a clap), zeros are silence.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from audio.pcm import RATE
from audio.vad import WINDOW
from pipeline.asr.types import AsrRequest, DecodeRequest, DecodeResult, Transcript
from pipeline.engines import Engines
from pipeline.errors import Busy
from pipeline.llm.types import FinishReason, GenRequest, GenStats
from pipeline.serving.types import StageLoad
from pipeline.tools.toolbox import Toolbox
from pipeline.tts.types import Phrase, Speech

WORD_LEVEL = 0.05
"""Audio at or above this amplitude holds words; quieter non-zero audio is wordless speech."""
WORD_WINDOWS = 8
"""The fake ASR hears one word per 8 loud 512-sample windows (256 ms)."""
VOCAB = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet",
         "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango")


# ---- audio --------------------------------------------------------------------------------


def tone(ms: float, amp: float = 0.3, hz: float = 220.0) -> np.ndarray:
    """A sine: speech with words (float32 at 16 kHz, shape (ms·16,))."""
    t = np.arange(int(ms * RATE / 1000)) / RATE
    return (amp * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def noise(ms: float, amp: float = 0.01, seed: int = 0) -> np.ndarray:
    """Quiet noise: speech to the fake VAD, no words to the fake ASR (float32, 16 kHz)."""
    x = np.random.default_rng(seed).uniform(-amp, amp, int(ms * RATE / 1000))
    x[x == 0] = amp / 2
    return x.astype(np.float32)


def silence(ms: float) -> np.ndarray:
    """Zeros (float32, 16 kHz)."""
    return np.zeros(int(ms * RATE / 1000), np.float32)


def pcm16(x: np.ndarray) -> bytes:
    """Float32 in [-1, 1] → little-endian PCM16 bytes (the default wire format)."""
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


# ---- VAD ----------------------------------------------------------------------------------


class EnergyVadStream:
    """Probability 1.0 for a 512-sample window with any non-zero sample, else 0.0."""

    def __init__(self) -> None:
        self._pending = np.zeros(0, np.float32)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Consume 16 kHz float32 samples; one probability per completed window."""
        buf = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        k = len(buf) // WINDOW
        self._pending = buf[k * WINDOW :]
        wins = buf[: k * WINDOW].reshape(k, WINDOW)
        return (np.abs(wins).max(axis=1, initial=0.0) > 1e-4).astype(np.float32)


class FakeVad:
    """The energy VAD as a shared model."""

    def stream(self) -> EnergyVadStream:
        return EnergyVadStream()


class ScriptedVadStream:
    """Returns given probabilities, one per completed window (then ``default``)."""

    def __init__(self, probs: Sequence[float], default: float = 0.0) -> None:
        self._probs = list(probs)
        self._default = default
        self._pending = 0

    def feed(self, samples: np.ndarray) -> np.ndarray:
        n = self._pending + len(samples)
        self._pending = n % WINDOW
        k = n // WINDOW
        out = [self._probs.pop(0) if self._probs else self._default for _ in range(k)]
        return np.asarray(out, dtype=np.float32)


# ---- stages -------------------------------------------------------------------------------


class _Stage:
    """A stage's load as plain attributes that tests set (``llm.depth = 16``); :meth:`load`
    snapshots them."""

    depth = 0
    urgent_depth = 0

    def load(self) -> StageLoad:
        return StageLoad(depth=self.depth, urgent_depth=self.urgent_depth)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class FakeAsr(_Stage):
    """Hears one word of :data:`VOCAB` per 256 ms of loud audio in a request (counting
    from its start) and answers the words after the request's prefix.

    Args:
        delay_s: time each decode takes.
        error: raised by every decode instead (e.g. ``Busy("asr")``).
        vocab: the words it hears instead of :data:`VOCAB` (word *i* is ``vocab[i % len(vocab)]``),
            e.g. ``("Yeah.",)`` for a backchannel.
        language: the language it detects (ISO code; may be changed between turns); other
            than ``"en"``, the fake is multilingual (``languages``: English and it).
    """

    multilingual = False
    languages = ["en"]

    def __init__(self, *, delay_s: float = 0.0, error: Exception | None = None,
                 vocab: Sequence[str] | None = None, language: str = "en") -> None:
        self.delay_s, self.error, self.vocab = delay_s, error, vocab
        self.language = language
        if language != "en":
            self.multilingual, self.languages = True, ["en", language]
        self.requests: list[DecodeRequest | AsrRequest] = []

    @staticmethod
    def words(audio: np.ndarray) -> list[str]:
        """The words the fake hears in ``audio``."""
        k = len(audio) // WINDOW
        loud = np.abs(audio[: k * WINDOW].reshape(k, WINDOW)).max(axis=1, initial=0.0) >= WORD_LEVEL
        n = int(np.count_nonzero(loud)) // WORD_WINDOWS
        return [VOCAB[i % len(VOCAB)] for i in range(n)]

    async def run(self, item: DecodeRequest | AsrRequest) -> DecodeResult | Transcript:
        self.requests.append(item)
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        words = self.words(item.audio)
        if self.vocab:
            words = [self.vocab[i % len(self.vocab)] for i in range(len(words))]
        if isinstance(item, AsrRequest):
            return Transcript(" ".join(words), self.language, len(item.audio) / RATE, 1.0)
        said = len(item.prefix.split())
        return DecodeResult(text=" ".join(words[said:]), language=self.language, decode_ms=1.0)


@dataclass(slots=True)
class Delta:
    """One scripted LLM delta: ``text`` after ``delay_s``."""

    text: str
    delay_s: float = 0.0


@dataclass(slots=True)
class LlmReply:
    """A scripted answer to one request: deltas, then the end (or ``error`` raised by the
    stream after them)."""

    deltas: list[Delta] = field(default_factory=list)
    error: Exception | None = None

    @staticmethod
    def of(*texts: str, delay_s: float = 0.0) -> LlmReply:
        """Deltas ``texts``, each after ``delay_s``."""
        return LlmReply([Delta(t, delay_s) for t in texts])


class FakeTokenStream:
    """Plays one :class:`LlmReply`; :meth:`abort` ends it (and is recorded)."""

    def __init__(self, reply: LlmReply) -> None:
        self.reply = reply
        self.stats = GenStats()
        self.aborted = False
        self._it = self._play()

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        return await self._it.__anext__()

    def abort(self) -> None:
        self.aborted = True

    async def _play(self) -> AsyncIterator[str]:
        for d in self.reply.deltas:
            await asyncio.sleep(d.delay_s)
            if self.aborted:
                self.stats.finish_reason = FinishReason.ABORT
                return
            self.stats.output_tokens += 1
            yield d.text
        if self.reply.error is not None:
            self.stats.finish_reason = FinishReason.ERROR
            raise self.reply.error
        self.stats.finish_reason = FinishReason.STOP


class FakeLlm(_Stage):
    """Answers request *i* with ``script[i]`` (a :class:`LlmReply`, or an exception such
    as :class:`~pipeline.errors.Busy` raised by ``submit``); past the script, ``default``.

    Attributes:
        requests: every request submitted, in order.
        streams: their streams (``streams[i].aborted``: request *i* was aborted).
        ended_sessions: sessions reported ended (:meth:`end_session`), in order.
    """

    def __init__(self, script: Sequence[LlmReply | Exception] = (), *,
                 default: LlmReply | None = None) -> None:
        self.script = list(script)
        self.default = default or LlmReply.of("Okay.")
        self.requests: list[GenRequest] = []
        self.streams: list[FakeTokenStream] = []
        self.ended_sessions: list[str] = []

    def submit(self, req: GenRequest) -> FakeTokenStream:
        i = len(self.requests)
        self.requests.append(req)
        answer = self.script[i] if i < len(self.script) else self.default
        if isinstance(answer, Exception):
            raise answer
        stream = FakeTokenStream(answer)
        self.streams.append(stream)
        return stream

    def end_session(self, session: str) -> None:
        self.ended_sessions.append(session)

    def count_tokens(self, messages: list[dict], tools: tuple = ()) -> int:
        return sum(len(str(m["content"]).split()) + 4 for m in messages) + 20 * len(tools)

    active = 0
    slots = 8
    kv_reserved = 0
    kv_budget = 1 << 20
    step_ms = 0.0

    def load(self) -> StageLoad:
        return StageLoad(depth=self.depth, urgent_depth=self.urgent_depth, active=self.active, slots=self.slots,
                         kv_reserved=self.kv_reserved, kv_budget=self.kv_budget, step_ms=self.step_ms)

    @property
    def aborted(self) -> list[int]:
        """Indices of the requests whose stream was aborted."""
        return [i for i, s in enumerate(self.streams) if s.aborted]


class FakeTts(_Stage):
    """Speaks ``s_per_char`` seconds of a quiet tone per character (or ``script[text]``).

    Args:
        s_per_char: audio length per character of the phrase (s).
        hz: the tone's frequency (0: a constant level of 0.1, which a codec such as Opus,
            whose high-pass drops DC, turns into silence; otherwise a sine of RMS 0.1).
        delay_s: synthesis time per phrase.
        rate: output sample rate (Hz).
        script: exact audio per phrase text (float32), overriding the length rule.
    """

    def __init__(self, *, s_per_char: float = 0.02, delay_s: float = 0.0, rate: int = 24000,
                 script: dict[str, np.ndarray] | None = None, hz: float = 0.0) -> None:
        self.s_per_char, self.delay_s, self.rate, self.hz = s_per_char, delay_s, rate, hz
        self.script = script or {}
        self.phrases: list[str] = []
        self.voices: list[str | None] = []  # each phrase's voice (None: the default)

    async def run(self, item: str | Phrase, *, priority: int | None = None) -> Speech:
        phrase = item if isinstance(item, Phrase) else Phrase(item)
        item = phrase.text
        self.phrases.append(item)
        self.voices.append(phrase.voice)
        await asyncio.sleep(self.delay_s)
        audio = self.script.get(item)
        if audio is None:
            n = int(len(item) * self.s_per_char * self.rate)
            audio = (np.full(n, 0.1, np.float32) if not self.hz else
                     (0.1 * np.sqrt(2) * np.sin(2 * np.pi * self.hz * np.arange(n) / self.rate)).astype(np.float32))
        return Speech(audio, self.rate, self.delay_s * 1000, phrase.voice or "")


class FakeEot(_Stage):
    """An end-of-turn model that answers from a script: each call takes the next answer (a
    probability, or an exception to raise), then ``default``, after ``delay_s``; it records
    the audio it got."""

    def __init__(self, script: Sequence[float | Exception] = (), *, default: float = 0.0,
                 delay_s: float = 0.0) -> None:
        super().__init__()
        self.script, self.default, self.delay_s = list(script), default, delay_s
        self.calls: list[np.ndarray] = []

    async def run(self, item: np.ndarray) -> float:
        self.calls.append(item)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        answer = self.script.pop(0) if self.script else self.default
        if isinstance(answer, Exception):
            raise answer
        return answer


def fake_engines(*, asr: FakeAsr | None = None, llm: FakeLlm | None = None, tts: FakeTts | None = None,
                 vad: FakeVad | None = None, eot: FakeEot | None = None, tools: Toolbox | None = None) -> Engines:
    """:class:`Engines` over fakes (defaults for any not given; no end-of-turn model unless
    ``eot``; server-side ``tools``, real ones, if given)."""
    return Engines(vad=vad or FakeVad(), asr=asr or FakeAsr(), llm=llm or FakeLlm(), tts=tts or FakeTts(), eot=eot,
                   tools=tools)


class CharTokenizer:
    """One token per character (code points 2-255); 0 pads, 1 ends a sequence."""

    pad_token_id, eos_token_id = 0, 1

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>" * add_generation_prompt
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i < 2))


__all__ = ["Busy", "CharTokenizer", "Delta", "EnergyVadStream", "FakeAsr", "FakeEot", "FakeLlm", "FakeTts", "FakeVad",
           "LlmReply", "ScriptedVadStream", "fake_engines", "noise", "pcm16", "silence", "tone"]
