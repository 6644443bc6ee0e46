"""The single-turn voice table (``voxpipe bench voice``, and one run per ``--variant``): one
server, the clips played from 1 and from N concurrent sessions, one ``voxpipe ask`` per clip,
a row of per-response p50 / p95 per sessions value and ``--transport`` (PCM16 or Opus on the
WebSocket, or WebRTC: the transports take turns clip round by clip round, so drift hits them
alike)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from bench.server import free_port, start_server, stop_server


async def _session(url: str, clips: list[Path], out: list[dict], codec: str = "pcm") -> None:
    """One session: a ``voxpipe ask`` per clip (``codec``: ``pcm`` or ``opus``), in turn;
    appends to ``out`` a row per refused turn (``busy``, ``clip``) and per answered one (its
    ``timings_ms``, the client's voice-to-voice, ``clip``, the bytes sent per second of the
    clip and received per second of the reply)."""
    import soundfile as sf

    from clients.client import ask

    for clip in clips:
        if codec == "webrtc":
            out.append(await _rtc_turn(url, clip))
            continue
        res = await ask(str(clip), url=url, timeout_s=120, codec=codec)
        done = [e for e in res.events if e["type"] == "response.done"]
        if res.busy is not None:
            out.append({"busy": res.busy.get("reason"), "clip": clip.name})
        if not done:
            continue
        t = dict(done[-1]["timings_ms"])
        t["client_voice_to_voice"] = res.timings_ms.get("voice_to_voice")
        t["clip"] = clip.name
        t["up_bytes_per_s"] = res.bytes_sent / sf.info(str(clip)).duration
        t["down_bytes_per_s"] = res.reply_bytes / res.reply_audio_s if res.reply_audio_s else None
        out.append(t)


async def _rtc_turn(url: str, clip: Path, timeout_s: float = 120) -> dict:
    """One clip over WebRTC (``POST /webrtc/offer``, :class:`clients.rtc.RtcClient`: the clip
    as the microphone track in real time, then silence): the turn's row as :func:`_session`'s,
    the client's voice-to-voice counted from the end of speech (``speech.stopped``'s position
    on the track's clock) to the first loud frame of the reply track, and the bytes the peer
    connection moved (RTP, RTCP, SRTP and DTLS; silence frames both ways included)."""
    import numpy as np

    from audio.pcm import resample
    from audio.wav import read_mono
    from clients.rtc import RATE, RtcClient

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
        end = client.mic.t0 + stopped[-1]["audio_ms"] / 1000 if stopped and client.mic.t0 else client.at(ended)
        first = await client.wait_until(lambda: client.heard.first_loud(after=end), 30, "the reply's first audio")
        sent, received = await client.bytes_moved()
        row = dict(ended["timings_ms"])
        reply_s = ended.get("audio_s") or client.heard.loud_s(after=end)
        row.update(client_voice_to_voice=(first - end) * 1000, clip=clip.name,
                   up_bytes_per_s=sent / (len(x) / sr), down_bytes_per_s=received / reply_s if reply_s else None)
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
            "voice_to_voice", "client_voice_to_voice", "up_bytes_per_s", "down_bytes_per_s")
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


def single_turn_table(args: argparse.Namespace, clips: list[Path], extra: list[str],
                      log: str | None = None) -> list[dict]:
    """Start ``voxpipe serve --llm args.llm EXTRA``, play ``clips`` × ``args.repeat`` from each
    of ``args.sessions`` concurrent sessions (one row per value), stop the server.

    Returns:
        one dict per sessions value and transport (``getattr(args, "transport", ["pcm"])``):
        ``sessions``, ``transport``, ``responses``, ``busy``, ``within_slo`` (share of answered
        turns with client voice-to-voice <= ``args.slo_ms``), ``max_v2v`` (ms) and (p50, p95)
        of each of :data:`ROW_KEYS` (ms; ``tts_rtf`` unitless; bytes per second of audio).

    Raises:
        RuntimeError: the server exited or was not ready in 600 s.
    """
    port = free_port()
    proc = start_server(args.llm, port, extra, log=log)
    url = f"ws://127.0.0.1:{port}/ws"
    transports = list(getattr(args, "transport", None) or ["pcm"])
    table = []
    try:
        for n in args.sessions:
            rows: dict[str, list[dict]] = {t: [] for t in transports}

            async def run(n: int, per: list[Path], rows: list[dict], codec: str) -> None:
                orders = [per if args.lockstep else per[k % len(per):] + per[:k % len(per)] for k in range(n)]
                await asyncio.gather(*(_session(url, order, rows, codec) for order in orders))

            for _ in range(args.repeat):
                for t in transports:
                    asyncio.run(run(n, clips, rows[t], t))
            for t in transports:
                table.append(_row(n, t, rows[t], args.slo_ms))
    finally:
        stop_server(proc)
    return table
