"""Test helpers: drive a real voxpipe server over WebSocket and collect what comes back."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import jiwer
import numpy as np
from websockets.asyncio.client import connect

from audio.frames import parse_audio_frame

_NORMALIZER = None

# Deadlines only bound a hang; they are generous so that a slow or busy machine (two
# cores, both loaded) passes. Nothing here asserts how fast the server answers.
CONTROL_DEADLINE_S = 60.0  # an answer that needs no model (session.started, a protocol error)
MODEL_DEADLINE_S = 300.0  # an answer that runs ASR, the LLM or TTS


def normalize(text: str) -> str:
    """Whisper's English text normalizer (case, punctuation, spelled-out numbers,
    contractions), as shipped in transformers, so "forty-two" and "42" compare equal."""
    global _NORMALIZER
    if _NORMALIZER is None:
        from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

        _NORMALIZER = EnglishTextNormalizer({})
    return " ".join(_NORMALIZER(text).split())


def wer(ref: str, hyp: str) -> float:
    """Word error rate after :func:`normalize` (jiwer)."""
    return jiwer.wer(normalize(ref), normalize(hyp))


@dataclass
class Conversation:
    """Everything one connection received."""

    events: list[dict] = field(default_factory=list)
    audio: dict[int, list[bytes]] = field(default_factory=dict)
    order: list[tuple[str, int]] = field(default_factory=list)  # ("audio", rid) / ("event", index)

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def audio_after_event(self, rid: int, event: dict) -> int:
        """Audio frames of ``rid`` received after ``event``."""
        idx = self.events.index(event)
        pos = self.order.index(("event", idx))
        return sum(1 for kind, r in self.order[pos + 1 :] if kind == "audio" and r == rid)

    def reply_audio(self, rid: int) -> np.ndarray:
        raw = b"".join(self.audio.get(rid, []))
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


class Client:
    """A raw protocol client: send anything, collect everything."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conv = Conversation()
        self._reader: asyncio.Task | None = None
        self._new = asyncio.Event()

    async def __aenter__(self) -> Client:
        self.ws = await connect(self.url, max_size=None)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc) -> None:
        self._reader.cancel()
        # a connection the server already closed has nothing to close (closing it again
        # can hit asyncio's transport after it let go of its loop: AttributeError)
        if not self.ws.connection_lost_waiter.done():
            await self.ws.close()

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if isinstance(msg, bytes):
                    rid, pcm = parse_audio_frame(msg)
                    self.conv.audio.setdefault(rid, []).append(pcm)
                    self.conv.order.append(("audio", rid))
                else:
                    self.conv.events.append(json.loads(msg))
                    self.conv.order.append(("event", len(self.conv.events) - 1))
                self._new.set()
        except Exception:  # noqa: BLE001 - closed by the server
            self._new.set()

    async def send_json(self, obj) -> None:
        await self.ws.send(obj if isinstance(obj, str) else json.dumps(obj))

    async def send_audio(self, data: bytes, chunk: int = 3200) -> None:
        for i in range(0, len(data), chunk):
            await self.ws.send(data[i : i + chunk])

    async def wait_for(self, pred, deadline_s: float = MODEL_DEADLINE_S) -> dict:
        """Wait until an event satisfies ``pred`` (a type string or a callable); fail
        after ``deadline_s``. The deadline only bounds a hang: callers pass a generous
        one, never a latency they expect."""
        check = (lambda e: e["type"] == pred) if isinstance(pred, str) else pred
        seen = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        while True:
            for ev in self.conv.events[seen:]:
                if check(ev):
                    return ev
            seen = len(self.conv.events)
            self._new.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"no matching event in {deadline_s} s; got {[e['type'] for e in self.conv.events]}")
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except TimeoutError:
                pass

    async def wait_until(self, cond, deadline_s: float = MODEL_DEADLINE_S, what: str = "the condition") -> None:
        """Wait until ``cond()`` holds, re-checking whenever a message (event or audio)
        arrives; fail after ``deadline_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        while not cond():
            self._new.clear()
            if cond():
                return
            left = deadline - loop.time()
            if left <= 0:
                kinds = [e["type"] for e in self.conv.events]
                raise TimeoutError(f"{what} did not hold in {deadline_s} s; got {kinds}")
            try:
                await asyncio.wait_for(self._new.wait(), left)
            except TimeoutError:
                pass

    async def start(self, **fields) -> dict:
        await self.send_json({"type": "session.start", **fields})
        return await self.wait_for("session.started", CONTROL_DEADLINE_S)

    async def turn(self, data: bytes, deadline_s: float = MODEL_DEADLINE_S) -> dict:
        """Send a whole utterance then ``input.end``; return ``response.done`` or ``turn.empty``."""
        n = len(self.conv.events)
        await self.send_audio(data)
        await self.send_json({"type": "input.end"})
        return await self.wait_for(
            lambda e: e["type"] in ("response.done", "turn.empty") and self.conv.events.index(e) >= n, deadline_s
        )
