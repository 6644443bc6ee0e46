"""One spoken turn on an open voxpipe session, from the client's side: send the audio at
its pace, collect what the server answers (partial and final transcripts, the reply's text
and audio, ``busy``, ``turn.empty``, ``server.status``, errors) and the client-side timings.

``voxpipe ask`` (:func:`clients.client.ask`) drives one turn per connection with it; the
benchmarks drive many turns on one connection (``bench voice --turns``, ``bench edge``)::

    frames, rate, channels = pcm16_frames("question.wav")
    await ws.send(json.dumps({"type": "session.start", "sample_rate": rate, "format": "pcm16",
                              "channels": channels, "output_sample_rate": 24000}))
    res = await Turn(ws, output_rate=24000).run(frames, timeout_s=120)
    print(res.transcript, res.reply_text, res.timings_ms["voice_to_voice"])

A ``session.start`` on an open session keeps the conversation and restarts the audio
position at 0, so every turn's end of speech is measured as for a lone ``voxpipe ask``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from audio.frames import parse_audio_frame
from audio.pcm import OPUS_RATES, float_to_pcm16, resample
from audio.wav import read_audio

FRAME_MS = 20
"""Audio is sent in frames of this many milliseconds."""
OPUS_INPUT_BITRATE = 24000
"""A client's Opus bit rate for speech (bit/s): what WebRTC and Discord use for a voice."""
FAST_BURST_S, FAST_RATE_X = 50.0, 2.5
"""``ask --fast``: the first 50 s of audio as fast as possible, the rest at 2.5× real time —
within the server's default budget (60 s, then 3×: ``ServerConfig.audio_burst_s``,
``audio_rate_x``), whose turns beyond it are refused."""


@dataclass(slots=True)
class AskResult:
    """What one turn produced (see :meth:`as_json`).

    ``timings_ms`` (client side, from the end of the user's speech, ms; None when not seen):
    ``asr_final`` (→ ``transcript.final``), ``voice_to_voice`` (→ the reply's first audio
    frame), the server's ``llm_ttft`` and ``first_audio``; after a ``busy``, also ``busy``
    (→ the busy event) and ``busy_after_stop`` (the server's end-of-turn event → busy).
    """

    transcript: str = ""
    reply_text: str = ""
    bytes_sent: int = 0  # binary payload bytes this turn sent (audio) and received (every reply's audio)
    bytes_received: int = 0
    audio_sent_s: float = 0.0  # audio the turn sent (s): the file, and the silence after it with an open microphone
    reply_bytes: int = 0  # ... of the answered reply (``reply_audio``) alone
    reply_audio: list[np.ndarray] = field(default_factory=list)
    output_rate: int = 24000
    timings_ms: dict = field(default_factory=dict)
    partials: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    empty_reason: str | None = None  # the turn had no words: ``turn.empty``'s reason
    busy: dict | None = None  # the turn was refused: ``busy``'s reason, retry_after_ms, message
    status: dict | None = None  # the latest ``server.status`` (degraded, conditions), if any came
    text_only: bool = False  # the reply came without audio (the TTS stage's breaker was open)
    language: str | None = None  # ``transcript.final``'s language (ISO code; detected or fixed)
    voice: str | None = None  # the voice that spoke the reply (``response.done``'s ``voice``)

    @property
    def reply_audio_s(self) -> float:
        return sum(len(a) for a in self.reply_audio) / self.output_rate

    def as_json(self) -> dict:
        return {"transcript": self.transcript, "reply_text": self.reply_text,
                "reply_audio_s": round(self.reply_audio_s, 3), "timings_ms": self.timings_ms,
                "partials": self.partials, "turn_empty": self.empty_reason, "busy": self.busy,
                "errors": [{"code": e.get("code"), "message": e.get("message")} for e in self.errors],
                "text_only": self.text_only, "status": self.status, "language": self.language, "voice": self.voice,
                "bytes": {"sent": self.bytes_sent, "received": self.bytes_received, "reply": self.reply_bytes}}


def pcm16_frames(path: str) -> tuple[list[bytes], int, int]:
    """An audio file (anything soundfile reads) as the frames a client sends.

    Returns:
        (frames, rate, channels): PCM16 little-endian frames of :data:`FRAME_MS` each (the
        last one may be shorter), at the file's own rate (Hz) and channel count (1 or 2;
        more channels are mixed down to 1). A PCM16 file's samples survive exactly.
    """
    data, rate = read_audio(path)
    channels = 1 if data.ndim == 1 else data.shape[1]
    if channels > 2:
        data, channels = data.mean(axis=1), 1
    pcm = float_to_pcm16(data)  # rounds: a PCM16 file's samples survive exactly
    step = rate * FRAME_MS // 1000 * 2 * channels
    return [pcm[i : i + step] for i in range(0, len(pcm), step)], rate, channels


def opus_frames(path: str) -> tuple[list[bytes], int, int]:
    """An audio file as the Opus packets a client sends (``format: "opus"``): mono, one
    :data:`FRAME_MS` packet per frame at :data:`OPUS_INPUT_BITRATE`, at the file's rate if
    Opus takes it, else at 48 kHz.

    Returns:
        (packets, rate, channels): the packets, the rate they were encoded at (Hz), 1.
    """
    from audio.opus import OpusEncoder

    data, rate = read_audio(path)
    if data.ndim > 1:
        data = data.mean(axis=1)
    if rate not in OPUS_RATES:
        data, rate = resample(data, rate, 48000), 48000
    enc = OpusEncoder(rate, OPUS_INPUT_BITRATE)
    return enc.encode(float_to_pcm16(data)) + enc.flush(), rate, 1


def opus_silence(rate: int) -> bytes:
    """One :data:`FRAME_MS` Opus packet of silence at ``rate`` (what an open microphone
    sends after the words, ``Turn.run(then_silence=True)``)."""
    from audio.opus import OpusEncoder

    return OpusEncoder(rate, OPUS_INPUT_BITRATE).encode(bytes(rate * FRAME_MS // 1000 * 2))[0]


class Turn:
    """Drives one turn on an open session ``ws`` (a websockets client connection whose
    ``session.start`` was sent): :meth:`send` streams the audio, :meth:`receive` collects
    the server's events into :attr:`result`, :meth:`finish` sets its timings; :meth:`run`
    does all three.

    Args:
        ws: the open connection.
        output_rate: the reply audio rate the ``session.start`` asked for (Hz).
        opus_reply: the ``session.start`` asked for Opus reply audio (``output_format``):
            each binary frame's packet is decoded (:class:`audio.opus.ReplyDecoder`).
        silence: the frame an open microphone sends after the words (``then_silence``;
            default: PCM zeros as long as the first frame).
        on_partial: called with each ``{"t_ms", "text"}`` partial transcript as it arrives
            (``t_ms``: since the first audio was sent).
        on_status: called with each ``server.status`` event (the service level changed).
    """

    def __init__(self, ws: Any, *, output_rate: int = 24000, on_partial: Callable[[dict], None] | None = None,
                 on_status: Callable[[dict], None] | None = None, opus_reply: bool = False,
                 silence: bytes | None = None) -> None:
        from audio.opus import ReplyDecoder

        self.ws = ws
        self.reply_decoder = ReplyDecoder(output_rate) if opus_reply else None
        self.silence = silence
        self.result = AskResult(output_rate=output_rate)
        self.on_partial = on_partial
        self.on_status = on_status
        self._marks: dict[Any, Any] = {}  # event name → time (perf_counter s); "sent": each frame's send time

    async def run(self, frames: list[bytes], *, timeout_s: float, fast: bool = False,
                  then_silence: bool = False) -> AskResult:
        """Send ``frames`` (:meth:`send`) while receiving (:meth:`receive`) until the turn
        ends, stop the sender, and return :attr:`result` with its timings (:meth:`finish`).

        Raises:
            TimeoutError: the turn did not end within ``timeout_s``.
            websockets.exceptions.ConnectionClosed: the connection closed.
            (Either way the sender is stopped; a caller that carries on calls
            :meth:`finish` for the timings of what came.)
        """
        sender = asyncio.create_task(self.send(frames, fast=fast, then_silence=then_silence))
        try:
            await asyncio.wait_for(self.receive(), timeout_s)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        return self.finish(fast=fast)

    async def send(self, frames: list[bytes], *, fast: bool = False, then_silence: bool = False) -> None:
        """Send ``frames`` at real-time pace (``fast``: the first :data:`FAST_BURST_S` of audio
        at once, the rest at :data:`FAST_RATE_X` × real time), then ``input.end``; with
        ``then_silence``, silence at the same pace instead, until cancelled (an open
        microphone: the server's end-of-turn detection ends the turn)."""
        marks = self._marks
        silence = (self.silence if self.silence is not None else bytes(len(frames[0]))) if then_silence else b""
        marks["t0"] = time.perf_counter()
        sent = marks["sent"] = []  # when each frame actually went out (a busy client lags)
        i = 0
        while i < len(frames) or then_silence:
            at_s = i * FRAME_MS / 1000  # this frame's place in the audio
            due = at_s if not fast else max(0.0, at_s - FAST_BURST_S) / FAST_RATE_X
            delay = marks["t0"] + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            frame = frames[i] if i < len(frames) else silence
            await self.ws.send(frame)
            self.result.bytes_sent += len(frame)
            self.result.audio_sent_s += FRAME_MS / 1000
            sent.append(time.perf_counter())
            if then_silence and i == len(frames) - 1:
                marks["input_end"] = sent[-1]
            i += 1
        marks["input_end"] = time.perf_counter()
        await self.ws.send(json.dumps({"type": "input.end"}))

    async def receive(self) -> None:
        """Collect the server's events and reply audio into :attr:`result` until the turn
        ends: once the audio is all sent, at ``response.done``, ``turn.empty`` or ``busy``;
        at a fatal ``error``; at an erroring ``response.cancelled``; or when the connection
        closes cleanly."""
        res, marks = self.result, self._marks
        audio: dict[int, list[np.ndarray]] = {}
        per_reply: dict[int, int] = {}  # payload bytes per response_id
        async for msg in self.ws:
            now = time.perf_counter()
            if isinstance(msg, bytes):
                rid, pcm = parse_audio_frame(msg)
                res.bytes_received += len(pcm)
                per_reply[rid] = per_reply.get(rid, 0) + len(pcm)
                if self.reply_decoder is not None:
                    pcm = self.reply_decoder.pcm16(rid, pcm)
                marks.setdefault(("first_audio", rid), now)
                audio.setdefault(rid, []).append(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768)
                continue
            ev = json.loads(msg)
            res.events.append(ev)
            if ev.get("type") == "response.done":
                res.reply_bytes = per_reply.get(ev.get("response_id", -1), 0)
            if self._event(ev, now, audio):
                return

    def _event(self, ev: dict, now: float, audio: dict[int, list[np.ndarray]]) -> bool:
        """Take one server event into the result; True when it ends the turn."""
        res, marks = self.result, self._marks
        kind = ev["type"]
        if kind == "transcript.partial" and "t0" in marks:
            res.partials.append({"t_ms": round((now - marks["t0"]) * 1000, 1), "text": ev["text"]})
            if self.on_partial is not None:
                self.on_partial(res.partials[-1])
        elif kind == "speech.stopped":
            marks["speech_end_audio_ms"] = ev["audio_ms"]
            marks.setdefault("speech_stopped", now)
            marks["speech_stopped_last"] = now
        elif kind == "transcript.final":
            marks["asr_final"] = now
            res.language = ev.get("language")
        elif kind == "response.started":
            res.transcript = ev.get("user_text", "")
        elif kind == "response.done":
            rid = ev["response_id"]
            res.reply_text = ev["text"]
            res.text_only = bool(ev.get("text_only"))
            res.voice = ev.get("voice")
            res.reply_audio = audio.get(rid, [])
            if ("first_audio", rid) in marks:
                marks["first_audio"] = marks[("first_audio", rid)]
            res.timings_ms["server"] = ev.get("timings_ms", {})
            return "input_end" in marks
        elif kind == "turn.empty":
            res.empty_reason = ev.get("reason")
            return "input_end" in marks
        elif kind == "busy":
            if "busy" not in marks:
                marks["busy"] = now
                marks["busy_stop"] = marks.get("speech_stopped_last", now)  # the end it answers
            res.busy = {k: ev.get(k) for k in ("reason", "retry_after_ms", "message")}
            return "input_end" in marks
        elif kind == "server.status":
            res.status = {"degraded": bool(ev.get("degraded")), "conditions": ev.get("conditions") or []}
            if self.on_status is not None:
                self.on_status(ev)
        elif kind == "error":
            res.errors.append(ev)
            return bool(ev.get("fatal"))
        elif kind == "response.cancelled" and ev.get("reason") == "error" and "input_end" in marks:
            return True  # the reply failed (its error came just before): no reply is coming
        return False

    def finish(self, *, fast: bool = False) -> AskResult:
        """Set :attr:`result`'s client-side timings (ms) and return it. End of speech = when
        the last speech sample was sent (real-time pacing: its place in the audio, plus how
        late its frame went out when the sender fell behind), or when the audio ended
        (``fast``). Call it once, after the turn."""
        res, marks = self.result, self._marks
        if not fast and "speech_end_audio_ms" in marks:
            e_ms, sent = marks["speech_end_audio_ms"], marks.get("sent", [])
            k = min(len(sent) - 1, max(0, math.ceil(e_ms / FRAME_MS) - 1))
            lag = max(0.0, sent[k] - (marks["t0"] + k * FRAME_MS / 1000)) if sent else 0.0
            end = marks["t0"] + e_ms / 1000 + lag
        else:
            end = marks.get("input_end", marks.get("t0", 0.0))
        server = res.timings_ms.pop("server", {})

        def since_end(key: str) -> float | None:
            return round((marks[key] - end) * 1000, 1) if key in marks else None

        res.timings_ms.update(asr_final=since_end("asr_final"), llm_ttft=server.get("llm_ttft"),
                              first_audio=server.get("first_audio"), voice_to_voice=since_end("first_audio"))
        if "busy" in marks:  # end of speech → the busy event, at the client
            res.timings_ms["busy"] = since_end("busy")
            # the server's end-of-turn event (the one just before the busy) → busy: the decision's cost
            res.timings_ms["busy_after_stop"] = round((marks["busy"] - marks["busy_stop"]) * 1000, 1)
        return res


__all__ = ["FAST_BURST_S", "FAST_RATE_X", "FRAME_MS", "AskResult", "Turn", "opus_frames", "opus_silence",
           "pcm16_frames"]
