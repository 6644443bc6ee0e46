"""``voxpipe ask``: stream an audio file to a server and collect the spoken reply."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from audio.frames import parse_audio_frame
from audio.pcm import float_to_pcm16
from audio.wav import read_audio, write_wav

FRAME_MS = 20
"""Audio is sent in frames of this many milliseconds."""
FAST_BURST_S, FAST_RATE_X = 50.0, 2.5
"""``ask --fast``: the first 50 s of audio as fast as possible, the rest at 2.5× real time —
within the server's default budget (60 s, then 3×: ``ServerConfig.audio_burst_s``,
``audio_rate_x``), whose turns beyond it are refused."""

BUSY_REASONS = {
    "queue": "the reply would miss the latency target",
    "memory": "the language model's memory is full",
    "sessions": "too many sessions are open",
    "stage": "a processing stage's queue is full",
    "ladder": "a model ran out of memory: new turns are refused while it recovers",
    "breaker": "a processing stage is failing or too slow: its circuit breaker is open",
    "rate_limited": "this client sends audio or events faster than the server allows",
}
"""What each ``busy`` reason means, in plain words (docs/PROTOCOL.md, "Admission" and
"Degraded service")."""

CLOSE_TRY_AGAIN_LATER = 1013
"""Close code of a session refused by the server's session cap right after the upgrade."""
SESSIONS_RETRY_MS = 5000
"""Retry hint for a session refused without a ``Retry-After`` (the server sends 5 s)."""


def describe_busy(busy: dict) -> str:
    """One line for a ``busy`` event (or a refused session): the reason in plain words and
    the server's message, e.g. ``server busy (queue): the reply would miss the latency
    target: a reply now would take ~3262 ms, over the 2000 ms SLO``."""
    reason = busy.get("reason") or "unknown"
    line = f"server busy ({reason}): {BUSY_REASONS.get(reason, 'it cannot take this turn now')}"
    return f"{line}: {busy['message']}" if busy.get("message") else line


def describe_condition(cond: dict) -> str:
    """One degradation of a ``server.status`` in words, e.g. ``llm out-of-memory step 2 —
    new turns refused`` (what is degraded, then the server's ``effect``)."""
    source, stage, level = cond.get("source"), cond.get("stage"), str(cond.get("level", "?"))
    if source == "ladder":
        what = f"{stage or 'a stage'} out-of-memory step {level}"
    elif source == "breaker":
        what = f"{stage or 'a stage'} breaker {level.replace('_', '-')}"
    elif source == "slo":
        what = f"latency over the SLO, level {level}"
    else:  # a source this client does not know yet
        what = " ".join(str(x) for x in (source or "condition", stage, level) if x)
    effect = cond.get("effect")
    return f"{what} — {effect}" if effect else what


def describe_status(status: dict, *, column: int = 0) -> str:
    """One line for a ``server.status`` event: ``degraded: <each condition>`` while the
    server is degraded, ``service: back to normal`` once it is not; ``column`` pads the
    label (``voxpipe ask`` aligns it with its other lines: ``degraded:   ...``)."""
    if not status.get("degraded"):
        label, text = "service:", "back to normal"
    else:
        conditions = status.get("conditions") or []
        label, text = "degraded:", "; ".join(describe_condition(c) for c in conditions) or "(no details)"
    return f"{label:<{column}}" + (text if column > len(label) else f" {text}")


def sessions_busy(message: str, retry_after_s: str | float | None = None) -> dict:
    """A refused session (HTTP 503 before the upgrade, close 1013 after it) as a ``busy``
    event's fields: reason ``sessions``, ``retry_after_ms`` from ``Retry-After`` (seconds)."""
    try:
        retry_ms = round(float(retry_after_s) * 1000) if retry_after_s is not None else SESSIONS_RETRY_MS
    except (ValueError, OverflowError):  # an HTTP date, or garbage: the server's usual hint
        retry_ms = SESSIONS_RETRY_MS
    return {"reason": "sessions", "retry_after_ms": max(0, retry_ms),
            "message": message.strip() or "the server is at its session cap"}


def refused_session(exc: BaseException) -> dict | None:
    """The ``busy`` fields if ``exc`` is the session cap's refusal (an HTTP 503 answer to the
    upgrade, or close code 1013), else None."""
    from websockets.exceptions import ConnectionClosed, InvalidStatus

    if isinstance(exc, InvalidStatus) and exc.response.status_code == 503:
        return sessions_busy(exc.response.body.decode("utf-8", "replace") if exc.response.body else "",
                             exc.response.headers.get("Retry-After"))
    if isinstance(exc, ConnectionClosed) and exc.rcvd is not None and exc.rcvd.code == CLOSE_TRY_AGAIN_LATER:
        return sessions_busy(exc.rcvd.reason)
    return None


class ServerUnavailable(ConnectionError):
    """No voxpipe server answered at the URL."""


class AccessDenied(ConnectionError):
    """The server refused this client before the upgrade: HTTP 401 (no or a wrong token) or
    403 (a Host or Origin it does not accept). The message says which and what to do."""


EXIT_DENIED = 6
"""Exit status of ``ask`` and ``mic`` when the server refused the client (401/403)."""


def auth_headers(token: str | None) -> dict[str, str]:
    """The handshake headers that carry ``token`` (``Authorization: Bearer``), if any."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def access_denied(exc: BaseException) -> AccessDenied | None:
    """``exc`` as :class:`AccessDenied` if it is the server's 401/403 answer to the upgrade."""
    from websockets.exceptions import InvalidStatus

    if not isinstance(exc, InvalidStatus) or exc.response.status_code not in (401, 403):
        return None
    said = exc.response.body.decode("utf-8", "replace").strip()[:300] if exc.response.body else ""
    hint = (" (pass --token or set VOXPIPE_TOKEN)" if exc.response.status_code == 401 else "")
    return AccessDenied(f"the server refused this client (HTTP {exc.response.status_code}): {said}{hint}")


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
    status: dict | None = None  # the latest ``server.status`` (degraded, conditions), if any came
    text_only: bool = False  # the reply came without audio (the TTS stage's breaker was open)

    @property
    def reply_audio_s(self) -> float:
        return sum(len(a) for a in self.reply_audio) / self.output_rate

    def as_json(self) -> dict:
        return {"transcript": self.transcript, "reply_text": self.reply_text,
                "reply_audio_s": round(self.reply_audio_s, 3), "timings_ms": self.timings_ms,
                "partials": self.partials, "turn_empty": self.empty_reason, "busy": self.busy,
                "errors": [{"code": e.get("code"), "message": e.get("message")} for e in self.errors],
                "text_only": self.text_only, "status": self.status}


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
              on_partial: Callable[[dict], None] | None = None,
              on_status: Callable[[dict], None] | None = None, token: str | None = None) -> AskResult:
    """Stream ``path`` (any soundfile-readable file, sent as PCM16 at its own rate and
    channel count) at real-time pace (``fast``: as fast as the server's default budget
    allows, :data:`FAST_BURST_S`), send ``input.end``, and
    wait for the reply. ``on_partial`` is called with each ``{"t_ms", "text"}`` partial
    transcript as it arrives (``t_ms``: since the first audio was sent); ``on_status``
    with each ``server.status`` event (the server's service level changed: degraded or back
    to normal). ``token``: the server's bearer token, if it needs one.

    A session refused by the server's session cap (HTTP 503, or close code 1013) comes back
    as ``busy`` with reason ``sessions``, like a refused turn.

    Raises:
        ServerUnavailable: nothing accepts a WebSocket at ``url``.
        AccessDenied: the server refused this client (a missing or wrong token: HTTP 401).
        TimeoutError: no reply within ``timeout_s``.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    frames, rate, channels = _pcm16_frames(path)
    res = AskResult(output_rate=output_rate)
    try:
        ws = await asyncio.wait_for(connect(url, max_size=None, open_timeout=10,
                                            additional_headers=auth_headers(token)), 15)
    except (TimeoutError, OSError) as exc:
        raise ServerUnavailable(f"no voxpipe server at {url} ({exc})") from None
    except InvalidHandshake as exc:
        denied = access_denied(exc)
        if denied is not None:
            raise denied from None
        res.busy = refused_session(exc)
        if res.busy is None:
            raise ServerUnavailable(f"no voxpipe server at {url} ({exc})") from None
        return res
    marks: dict = {}  # event name → time (s); "sent": each frame's send time
    async with ws:
        start = {"type": "session.start", "sample_rate": rate, "format": "pcm16", "channels": channels,
                 "output_sample_rate": output_rate}
        if language:
            start["language"] = language
        try:
            await ws.send(json.dumps(start))
        except ConnectionClosed as exc:  # the session cap's close 1013 can come this early
            res.busy = refused_session(exc)
            if res.busy is None:
                raise
            return res

        async def sender() -> None:
            marks["t0"] = time.perf_counter()
            sent = marks["sent"] = []  # when each frame actually went out (a busy client lags)
            for i, frame in enumerate(frames):
                at_s = i * FRAME_MS / 1000  # this frame's place in the audio
                due = at_s if not fast else max(0.0, at_s - FAST_BURST_S) / FAST_RATE_X
                delay = marks["t0"] + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                await ws.send(frame)
                sent.append(time.perf_counter())
            marks["input_end"] = time.perf_counter()
            await ws.send(json.dumps({"type": "input.end"}))

        send_task = asyncio.create_task(sender())
        try:
            await asyncio.wait_for(_receive(ws, res, marks, on_partial, on_status), timeout_s)
        except ConnectionClosed as exc:
            res.busy = refused_session(exc)
            if res.busy is None:
                raise
        finally:
            send_task.cancel()
            await asyncio.gather(send_task, return_exceptions=True)
    _timings(res, marks, fast)
    return res


async def _receive(ws, res: AskResult, marks: dict, on_partial: Callable[[dict], None] | None,
                   on_status: Callable[[dict], None] | None = None) -> None:
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
            marks["speech_stopped_last"] = now
        elif kind == "transcript.final":
            marks["asr_final"] = now
        elif kind == "response.started":
            res.transcript = ev.get("user_text", "")
        elif kind == "response.done":
            rid = ev["response_id"]
            res.reply_text = ev["text"]
            res.text_only = bool(ev.get("text_only"))
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
            if "busy" not in marks:
                marks["busy"] = now
                marks["busy_stop"] = marks.get("speech_stopped_last", now)  # the end it answers
            res.busy = {k: ev.get(k) for k in ("reason", "retry_after_ms", "message")}
            if "input_end" in marks:
                return
        elif kind == "server.status":
            res.status = {"degraded": bool(ev.get("degraded")), "conditions": ev.get("conditions") or []}
            if on_status is not None:
                on_status(ev)
        elif kind == "error":
            res.errors.append(ev)
            if ev.get("fatal"):
                return
        elif kind == "response.cancelled" and ev.get("reason") == "error" and "input_end" in marks:
            return  # the reply failed (its error came just before): no reply is coming


def _timings(res: AskResult, marks: dict, fast: bool) -> None:
    """Client-side timings (ms). End of speech = when the last speech sample was sent
    (real-time pacing: its place in the audio, plus how late its frame went out when the
    sender fell behind), or when ``input.end`` was sent (``--fast``)."""
    if not fast and "speech_end_audio_ms" in marks:
        e_ms, sent = marks["speech_end_audio_ms"], marks.get("sent", [])
        k = min(len(sent) - 1, max(0, math.ceil(e_ms / FRAME_MS) - 1))
        lag = max(0.0, sent[k] - (marks["t0"] + k * FRAME_MS / 1000)) if sent else 0.0
        end = marks["t0"] + e_ms / 1000 + lag
    else:
        end = marks.get("input_end", marks.get("t0", 0.0))
    server = res.timings_ms.pop("server", {})

    def since_end(key: str):
        return round((marks[key] - end) * 1000, 1) if key in marks else None

    res.timings_ms.update(asr_final=since_end("asr_final"), llm_ttft=server.get("llm_ttft"),
                          first_audio=server.get("first_audio"), voice_to_voice=since_end("first_audio"))
    if "busy" in marks:  # end of speech → the busy event, at the client
        res.timings_ms["busy"] = since_end("busy")
        # the server's end-of-turn event (the one just before the busy) → busy: the decision's cost
        res.timings_ms["busy_after_stop"] = round((marks["busy"] - marks["busy_stop"]) * 1000, 1)


def save_reply(res: AskResult, path: str) -> None:
    """Write the reply audio (PCM16 WAV at the output rate)."""
    audio = np.concatenate(res.reply_audio) if res.reply_audio else np.zeros(0, np.float32)
    write_wav(path, audio, res.output_rate)
