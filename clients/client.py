"""``voxpipe ask``: stream an audio file to a server and collect the spoken reply."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import numpy as np

from audio.pcm import OPUS_RATES
from audio.wav import write_wav
from clients.turn import AskResult, Turn, opus_frames, opus_silence, pcm16_frames

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


async def ask(path: str, *, url: str, fast: bool = False, output_rate: int = 24000,
              timeout_s: float = 120.0, language: str | None = None,
              on_partial: Callable[[dict], None] | None = None,
              on_status: Callable[[dict], None] | None = None, token: str | None = None,
              codec: str = "pcm", open_mic: bool = False) -> AskResult:
    """Stream ``path`` (any soundfile-readable file, sent as PCM16 at its own rate and
    channel count) at real-time pace (``fast``: as fast as the server's default budget
    allows, :data:`clients.turn.FAST_BURST_S`), send ``input.end``, and wait for the reply
    (one :class:`clients.turn.Turn`). ``on_partial`` is called with each ``{"t_ms", "text"}`` partial
    transcript as it arrives (``t_ms``: since the first audio was sent); ``on_status``
    with each ``server.status`` event (the server's service level changed: degraded or back
    to normal). ``token``: the server's bearer token, if it needs one. ``codec``: ``pcm``,
    or ``opus`` (the audio sent as Opus packets, the reply asked for in Opus: a fraction
    of the bytes; a server without Opus answers ``error`` ``bad_event``). ``open_mic``:
    after the file, silence at the same pace instead of ``input.end``, as a live microphone
    (or a WebRTC track) sends: the server's end-of-turn detection ends the turn.

    A session refused by the server's session cap (HTTP 503, or close code 1013) comes back
    as ``busy`` with reason ``sessions``, like a refused turn.

    Raises:
        ServerUnavailable: nothing accepts a WebSocket at ``url``.
        AccessDenied: the server refused this client (a missing or wrong token: HTTP 401).
        TimeoutError: no reply within ``timeout_s``.
        ValueError: ``opus`` with an ``output_rate`` Opus does not take.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    opus = codec == "opus"
    if opus and output_rate not in OPUS_RATES:
        raise ValueError(f"Opus reply audio needs an Opus rate ({', '.join(map(str, OPUS_RATES))} Hz), "
                         f"not {output_rate}")
    frames, rate, channels = opus_frames(path) if opus else pcm16_frames(path)
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
    async with ws:
        start = {"type": "session.start", "sample_rate": rate, "format": "opus" if opus else "pcm16",
                 "channels": channels, "output_sample_rate": output_rate, "output_format": "opus" if opus else "pcm16"}
        if language:
            start["language"] = language
        try:
            await ws.send(json.dumps(start))
        except ConnectionClosed as exc:  # the session cap's close 1013 can come this early
            res.busy = refused_session(exc)
            if res.busy is None:
                raise
            return res
        turn = Turn(ws, output_rate=output_rate, on_partial=on_partial, on_status=on_status, opus_reply=opus,
                    silence=opus_silence(rate) if opus and open_mic else None)
        try:
            return await turn.run(frames, timeout_s=timeout_s, fast=fast, then_silence=open_mic)
        except ConnectionClosed as exc:
            turn.result.busy = refused_session(exc)
            if turn.result.busy is None:
                raise
    return turn.finish(fast=fast)


def save_reply(res: AskResult, path: str) -> None:
    """Write the reply audio (PCM16 WAV at the output rate)."""
    audio = np.concatenate(res.reply_audio) if res.reply_audio else np.zeros(0, np.float32)
    write_wav(path, audio, res.output_rate)
