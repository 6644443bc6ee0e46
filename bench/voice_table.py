"""The single-turn voice table (``voxpipe bench voice``, and one run per ``--variant``): one
server, the clips played from 1 and from N concurrent sessions, one ``voxpipe ask`` per clip,
a row of per-response p50 / p95 per sessions value and ``--transport`` (PCM16 or Opus on the
WebSocket, or WebRTC: the transports take turns, clip by clip at one session and clip round by
clip round at more, so drift and a busy machine hit them alike).

The client's voice-to-voice is measured at the same point on every transport: from when the
user's last speech sample went out to when the reply's first loud 20 ms (RMS over
:data:`clients.rtc.LOUD_RMS`) plays, the reply playing from its first received sample on. A
WebRTC reply track arrives in real time, so that is when its first loud frame is received; a
WebSocket reply comes ahead of real time, so it is its first audio frame's arrival plus where
its first loud 20 ms lies in it (:func:`first_loud_s`; a TTS voice starts its phrases with up
to ~40 ms of near silence). ``transport_ms`` is that minus the server's own voice-to-voice
(end of speech received → first audio handed to the transport), turn by turn: the time the
transport adds, up and down, without the models' time, which on a busy machine varies by
far more than the transports differ."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bench.server import free_port, start_server, stop_server

LOUD_WINDOW_S = 0.02
"""The reply's loudness is judged per window of this many seconds (one 20 ms packet)."""


def first_loud_s(audio: Sequence[np.ndarray], rate: int) -> float:
    """Where the first loud :data:`LOUD_WINDOW_S` window (RMS at least
    :data:`clients.rtc.LOUD_RMS`, full scale 1) of a reply's audio starts (s from its first
    sample): ``audio`` its chunks (float, mono) at ``rate`` Hz; 0.0 when none is loud."""
    from clients.rtc import LOUD_RMS

    x = np.concatenate(list(audio)) if len(audio) else np.zeros(0, np.float32)
    n = int(round(rate * LOUD_WINDOW_S))
    if n <= 0 or len(x) < n:
        return 0.0
    windows = x[: len(x) // n * n].astype(np.float64).reshape(-1, n)
    loud = np.nonzero(np.sqrt((windows**2).mean(axis=1)) >= LOUD_RMS)[0]
    return float(loud[0]) * n / rate if len(loud) else 0.0


async def _session(url: str, clips: list[Path], out: list[dict], codec: str = "pcm",
                   open_mic: bool = False) -> None:
    """One session: a ``voxpipe ask`` per clip (``codec``: ``pcm`` or ``opus``; ``webrtc``:
    :func:`_rtc_turn`; ``open_mic``: silence after the clip instead of ``input.end``), in
    turn; appends to ``out`` a row per refused turn (``busy``,
    ``clip``) and per answered one (its ``timings_ms``, the client's voice-to-voice to the
    reply's first loud 20 ms and ``transport_ms`` (ms, module docstring), ``clip``, the bytes
    sent per second of audio sent (the clip, and an open microphone's silence after it) and
    received per second of the reply)."""
    import soundfile as sf

    from clients.client import ask

    for clip in clips:
        if codec == "webrtc":
            out.append(await _rtc_turn(url, clip))
            continue
        res = await ask(str(clip), url=url, timeout_s=120, codec=codec, open_mic=open_mic)
        done = [e for e in res.events if e["type"] == "response.done"]
        if res.busy is not None:
            out.append({"busy": res.busy.get("reason"), "clip": clip.name})
        if not done:
            continue
        t = dict(done[-1]["timings_ms"])
        v2v = res.timings_ms.get("voice_to_voice")
        if v2v is not None:  # the first frame's arrival → when its first loud 20 ms plays
            v2v += 1000 * first_loud_s(res.reply_audio, res.output_rate)
            if t.get("voice_to_voice") is not None:
                t["transport_ms"] = v2v - t["voice_to_voice"]
        t["client_voice_to_voice"] = v2v
        t["clip"] = clip.name
        t["up_bytes_per_s"] = res.bytes_sent / (res.audio_sent_s or sf.info(str(clip)).duration)
        t["down_bytes_per_s"] = res.reply_bytes / res.reply_audio_s if res.reply_audio_s else None
        out.append(t)


async def _rtc_turn(url: str, clip: Path, timeout_s: float = 120) -> dict:
    """One clip over WebRTC (``POST /webrtc/offer``, :class:`clients.rtc.RtcClient`: the clip
    as the microphone track in real time, then silence): the turn's row as :func:`_session`'s,
    the client's voice-to-voice counted from the end of speech (``speech.stopped``'s position
    on the track's clock, :meth:`~clients.rtc.ClipTrack.spoken_at`) to the first loud frame of
    the reply track, and the bytes the peer connection moved (RTP, RTCP, SRTP and DTLS;
    silence frames both ways included) per second of the microphone track sent and of the
    reply."""
    import numpy as np

    from audio.pcm import resample
    from audio.wav import read_mono
    from clients.rtc import FRAME, RATE, RtcClient

    x, sr = read_mono(clip)
    pcm = (np.clip(resample(x, sr, RATE), -1, 1) * 32767).astype(np.int16)
    http = url.replace("ws://", "http://", 1).rsplit("/ws", 1)[0]
    client = RtcClient(http, pcm)
    try:
        await client.connect()
        ended = await client.wait_until(lambda: next((e for e in client.events if e["type"] in (
            "response.done", "turn.empty", "busy")), None), timeout_s, "the turn's end")
        if ended["type"] != "response.done":
            return {"busy": ended.get("reason") or ended["type"], "clip": clip.name}
        stopped = client.of("speech.stopped")
        end = (client.mic.spoken_at(stopped[-1]["audio_ms"]) if stopped else None) or client.at(ended)
        first = await client.wait_until(lambda: client.heard.first_loud(after=end), 30, "the reply's first audio")
        sent, received = await client.bytes_moved()
        mic_s = len(client.mic.sent_at) * FRAME / RATE  # the clip and the silence after it
        row = dict(ended["timings_ms"])
        reply_s = ended.get("audio_s") or client.heard.loud_s(after=end)
        v2v = (first - end) * 1000
        if row.get("voice_to_voice") is not None:
            row["transport_ms"] = v2v - row["voice_to_voice"]
        row.update(client_voice_to_voice=v2v, clip=clip.name, up_bytes_per_s=sent / (mic_s or len(x) / sr),
                   down_bytes_per_s=received / reply_s if reply_s else None)
        return row
    finally:
        await client.close()


def _stat(rows: list[dict], key: str) -> tuple[float, float]:
    """(p50, p95) of ``key`` over the rows that have it; (nan, nan) when none does."""
    xs = sorted(r[key] for r in rows if r.get(key) is not None)
    if not xs:
        return float("nan"), float("nan")
    return statistics.median(xs), xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


ROW_KEYS = ("first_audio", "first_token_to_audio", "first_phrase_to_audio", "tts_rtf", "llm_ttft", "asr",
            "voice_to_voice", "client_voice_to_voice", "transport_ms", "up_bytes_per_s", "down_bytes_per_s")
"""Per-turn timings (``response.done``'s ``timings_ms``, and the client's voice-to-voice) a
row summarizes as (p50, p95)."""


def _row(n: int, transport: str, rows: list[dict], slo_ms: float) -> dict:
    """The table row of ``n`` sessions over ``transport`` from its turns' ``rows``."""
    answered = [r for r in rows if "busy" not in r]
    v2v = [r["client_voice_to_voice"] for r in answered if r.get("client_voice_to_voice") is not None]
    row: dict = {"sessions": n, "transport": transport, "responses": len(answered), "busy": len(rows) - len(answered),
                 "within_slo": sum(x <= slo_ms for x in v2v) / len(v2v) if v2v else float("nan"),
                 "max_v2v": max(v2v, default=float("nan"))}
    for key in ROW_KEYS:
        row[key] = _stat(answered, key)
    return row


def turn_end(args: argparse.Namespace) -> str:
    """How the WebSocket clients end a turn: ``client`` (``input.end`` after the clip, as
    ``voxpipe ask`` sends a file) or ``server`` (silence after it, as a live microphone: the
    server's end-of-turn detection ends the turn, as it always does over WebRTC, whose
    client has no ``input.end`` to send). ``args.turn_end``, else ``server`` when WebRTC is
    compared, so every transport's turns end the same way."""
    chosen = getattr(args, "turn_end", None)
    if chosen:
        return chosen
    return "server" if "webrtc" in (getattr(args, "transport", None) or []) else "client"


def single_turn_table(args: argparse.Namespace, clips: list[Path], extra: list[str],
                      log: str | None = None) -> list[dict]:
    """Start ``voxpipe serve --llm args.llm EXTRA``, play ``clips`` × ``args.repeat`` from each
    of ``args.sessions`` concurrent sessions (one row per value), stop the server.

    Returns:
        one dict per sessions value and transport (``getattr(args, "transport", ["pcm"])``):
        ``sessions``, ``transport``, ``responses``, ``busy``, ``within_slo`` (share of answered
        turns with client voice-to-voice <= ``args.slo_ms``), ``max_v2v`` (ms) and (p50, p95)
        of each of :data:`ROW_KEYS` (ms; ``tts_rtf`` unitless; bytes per second of audio);
        with ``args.idle_cpu_s``, also ``idle_server_cpu_ms_per_s`` and
        ``idle_client_cpu_ms_per_s`` (:mod:`bench.transport_cpu`, measured after the turns).

    Raises:
        RuntimeError: the server exited or was not ready in 600 s.
    """
    port = free_port()
    proc = start_server(args.llm, port, extra, log=log)
    url = f"ws://127.0.0.1:{port}/ws"
    transports = list(getattr(args, "transport", None) or ["pcm"])
    open_mic = turn_end(args) == "server"
    table = []
    try:
        for n in args.sessions:
            rows: dict[str, list[dict]] = {t: [] for t in transports}

            async def run(n: int, per: list[Path], rows: list[dict], codec: str) -> None:
                orders = [per if args.lockstep else per[k % len(per):] + per[:k % len(per)] for k in range(n)]
                await asyncio.gather(*(_session(url, order, rows, codec, open_mic) for order in orders))

            for r in range(args.repeat):
                if n == 1:  # clip by clip, each transport in turn, who goes first rotating
                    for i, clip in enumerate(clips):
                        k = (r * len(clips) + i) % len(transports)
                        for t in transports[k:] + transports[:k]:
                            asyncio.run(run(n, [clip], rows[t], t))
                else:
                    for t in transports:
                        asyncio.run(run(n, clips, rows[t], t))
            for t in transports:
                table.append(_row(n, t, rows[t], args.slo_ms))
        idle_s = getattr(args, "idle_cpu_s", 0.0) or 0.0
        if idle_s > 0:
            from bench.transport_cpu import idle_cpu

            for idle in idle_cpu(url, proc.pid, transports, seconds=idle_s):
                for row in table:
                    if row["transport"] == idle.transport:
                        row["idle_server_cpu_ms_per_s"] = idle.server_ms_per_s
                        row["idle_client_cpu_ms_per_s"] = idle.client_ms_per_s
    finally:
        stop_server(proc)
    return table
