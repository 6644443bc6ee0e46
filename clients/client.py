"""``voxpipe ask``: stream an audio file to a server and collect the spoken reply."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from audio.pcm import float_to_pcm16
from audio.wav import read_audio, write_wav
from server.protocol import parse_audio_frame

FRAME_MS = 20
"""Audio is sent in frames of this many milliseconds."""


class ServerUnavailable(ConnectionError):
    """No voxpipe server answered at the URL."""


@dataclass(slots=True)
class AskResult:
    """What one ``ask`` produced (see :meth:`as_json`)."""

    transcript: str = ""
    reply_text: str = ""
    reply_audio: list[np.ndarray] = field(default_factory=list)
    output_rate: int = 24000
    timings_ms: dict = field(default_factory=dict)
    partials: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    empty_reason: str | None = None  # the turn had no words: ``turn.empty``'s reason
    busy: dict | None = None  # the turn was refused: ``busy``'s reason, retry_after_ms, message

    @property
    def reply_audio_s(self) -> float:
        return sum(len(a) for a in self.reply_audio) / self.output_rate

    def as_json(self) -> dict:
        return {"transcript": self.transcript, "reply_text": self.reply_text,
                "reply_audio_s": round(self.reply_audio_s, 3), "timings_ms": self.timings_ms,
                "partials": self.partials, "turn_empty": self.empty_reason, "busy": self.busy,
                "errors": [{"code": e.get("code"), "message": e.get("message")} for e in self.errors]}


def _pcm16_frames(path: str) -> tuple[list[bytes], int, int]:
    data, rate = read_audio(path)
    channels = 1 if data.ndim == 1 else data.shape[1]
    if channels > 2:
        data, channels = data.mean(axis=1), 1
    pcm = float_to_pcm16(data)  # rounds: a PCM16 file's samples survive exactly
    step = rate * FRAME_MS // 1000 * 2 * channels
    return [pcm[i : i + step] for i in range(0, len(pcm), step)], rate, channels


async def ask(path: str, *, url: str, fast: bool = False, output_rate: int = 24000,
              timeout_s: float = 120.0, language: str | None = None,
              on_partial: Callable[[dict], None] | None = None) -> AskResult:
    """Stream ``path`` (any soundfile-readable file, sent as PCM16 at its own rate and
    channel count) at real-time pace (or as fast as possible), send ``input.end``, and
    wait for the reply. ``on_partial`` is called with each ``{"t_ms", "text"}`` partial
    transcript as it arrives (``t_ms``: since the first audio was sent).

    Raises:
        ServerUnavailable: nothing accepts a WebSocket at ``url``.
        TimeoutError: no reply within ``timeout_s``.
    """
    from websockets.asyncio.client import connect

    frames, rate, channels = _pcm16_frames(path)
    res = AskResult(output_rate=output_rate)
    try:
        ws = await asyncio.wait_for(connect(url, max_size=None, open_timeout=10), 15)
    except (TimeoutError, OSError) as exc:
        raise ServerUnavailable(f"no voxpipe server at {url} ({exc})") from None
    marks: dict[str, float] = {}
    async with ws:
        start = {"type": "session.start", "sample_rate": rate, "format": "pcm16", "channels": channels,
                 "output_sample_rate": output_rate}
        if language:
            start["language"] = language
        await ws.send(json.dumps(start))

        async def sender() -> None:
            marks["t0"] = time.perf_counter()
            for i, frame in enumerate(frames):
                if not fast:
                    delay = marks["t0"] + i * FRAME_MS / 1000 - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(delay)
                await ws.send(frame)
            marks["input_end"] = time.perf_counter()
            await ws.send(json.dumps({"type": "input.end"}))

        send_task = asyncio.create_task(sender())
        try:
            await asyncio.wait_for(_receive(ws, res, marks, on_partial), timeout_s)
        finally:
            send_task.cancel()
            await asyncio.gather(send_task, return_exceptions=True)
    _timings(res, marks, fast)
    return res


async def _receive(ws, res: AskResult, marks: dict, on_partial: Callable[[dict], None] | None) -> None:
    audio: dict[int, list[np.ndarray]] = {}
    async for msg in ws:
        now = time.perf_counter()
        if isinstance(msg, bytes):
            rid, pcm = parse_audio_frame(msg)
            marks.setdefault(("first_audio", rid), now)
            audio.setdefault(rid, []).append(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768)
            continue
        ev = json.loads(msg)
        res.events.append(ev)
        kind = ev["type"]
        if kind == "transcript.partial" and "t0" in marks:
            res.partials.append({"t_ms": round((now - marks["t0"]) * 1000, 1), "text": ev["text"]})
            if on_partial is not None:
                on_partial(res.partials[-1])
        elif kind == "speech.stopped":
            marks["speech_end_audio_ms"] = ev["audio_ms"]
            marks.setdefault("speech_stopped", now)
        elif kind == "transcript.final":
            marks["asr_final"] = now
        elif kind == "response.started":
            res.transcript = ev.get("user_text", "")
        elif kind == "response.done":
            rid = ev["response_id"]
            res.reply_text = ev["text"]
            res.reply_audio = audio.get(rid, [])
            if ("first_audio", rid) in marks:
                marks["first_audio"] = marks[("first_audio", rid)]
            res.timings_ms["server"] = ev.get("timings_ms", {})
            if "input_end" in marks:
                return
        elif kind == "turn.empty":
            res.empty_reason = ev.get("reason")
            if "input_end" in marks:
                return
        elif kind == "busy":
            marks.setdefault("busy", now)
            res.busy = {k: ev.get(k) for k in ("reason", "retry_after_ms", "message")}
            if "input_end" in marks:
                return
        elif kind == "error":
            res.errors.append(ev)
            if ev.get("fatal"):
                return


def _timings(res: AskResult, marks: dict, fast: bool) -> None:
    """Client-side timings (ms). End of speech = when the last speech sample was sent
    (real-time pacing), or when ``input.end`` was sent (``--fast``)."""
    if not fast and "speech_end_audio_ms" in marks:
        end = marks["t0"] + marks["speech_end_audio_ms"] / 1000
    else:
        end = marks.get("input_end", marks.get("t0", 0.0))
    server = res.timings_ms.pop("server", {})

    def since_end(key: str):
        return round((marks[key] - end) * 1000, 1) if key in marks else None

    res.timings_ms.update(asr_final=since_end("asr_final"), llm_ttft=server.get("llm_ttft"),
                          first_audio=server.get("first_audio"), voice_to_voice=since_end("first_audio"))
    if "busy" in marks:  # end of speech → the busy event, at the client
        res.timings_ms["busy"] = since_end("busy")


def save_reply(res: AskResult, path: str) -> None:
    """Write the reply audio (PCM16 WAV at the output rate)."""
    audio = np.concatenate(res.reply_audio) if res.reply_audio else np.zeros(0, np.float32)
    write_wav(path, audio, res.output_rate)
