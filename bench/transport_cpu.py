"""What the transports cost in CPU (issue 34): the Opus codec per session (:func:`codec_cpu_line`)
and one open session per transport while nobody talks (:func:`idle_cpu`).

One connected session per transport in turn — PCM16 or Opus on ``/ws`` (48 kHz, 20 ms frames
of silence at real-time pace, as an open microphone sends) or WebRTC (``POST /webrtc/offer``:
:class:`clients.rtc.RtcClient` with an empty clip, so its track sends silence) — against a
running ``voxpipe serve``. After ``lead_s`` the server process's CPU time (all its threads,
psutil) and this process's (the client's: nothing else runs in it meanwhile) are read over
``seconds``: milliseconds of CPU per second (thousandths of a core). The models are idle, so
this is the transport's own cost (receive, decode, resample, VAD; the reply path's idle
traffic), which on a small machine the models' threads share the cores with.

Run through ``voxpipe bench voice --transport ... --idle-cpu-s S`` (printed after the table).
A measurement, not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

OPUS_RATE = 48000
FRAME_MS = 20


@dataclass(slots=True)
class IdleCpu:
    """One transport's idle session: CPU milliseconds per second of wall time."""

    transport: str
    server_ms_per_s: float
    client_ms_per_s: float


def _cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def _measure(server: psutil.Process, seconds: float, lead_s: float) -> tuple[float, float]:
    """(server, client) CPU ms per second over ``seconds``, after ``lead_s``."""
    me = psutil.Process()
    await asyncio.sleep(lead_s)
    s0, c0, t0 = _cpu_s(server), _cpu_s(me), time.perf_counter()
    await asyncio.sleep(seconds)
    s1, c1, t1 = _cpu_s(server), _cpu_s(me), time.perf_counter()
    return 1000 * (s1 - s0) / (t1 - t0), 1000 * (c1 - c0) / (t1 - t0)


async def _ws_session(url: str, codec: str, server: psutil.Process, seconds: float,
                      lead_s: float) -> tuple[float, float]:
    from websockets.asyncio.client import connect

    from clients.turn import opus_silence

    opus = codec == "opus"
    frame = opus_silence(OPUS_RATE) if opus else bytes(2 * OPUS_RATE * FRAME_MS // 1000)
    async with connect(url, max_size=None, open_timeout=10) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": OPUS_RATE,
                                  "format": "opus" if opus else "pcm16", "output_sample_rate": OPUS_RATE,
                                  "output_format": "opus" if opus else "pcm16"}))

        async def feed() -> None:
            t0, i = time.perf_counter(), 0
            while True:
                i += 1
                await asyncio.sleep(max(0.0, t0 + i * FRAME_MS / 1000 - time.perf_counter()))
                await ws.send(frame)

        async def drain() -> None:
            async for _ in ws:
                pass

        tasks = [asyncio.create_task(feed()), asyncio.create_task(drain())]
        try:
            return await _measure(server, seconds, lead_s)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _rtc_session(http: str, server: psutil.Process, seconds: float, lead_s: float) -> tuple[float, float]:
    import numpy as np

    from clients.rtc import RtcClient

    client = RtcClient(http, np.zeros(0, np.int16))
    try:
        await client.connect()
        return await _measure(server, seconds, lead_s)
    finally:
        await client.close()


def idle_cpu(url: str, server_pid: int, transports: list[str], seconds: float = 15.0,
             lead_s: float = 3.0) -> list[IdleCpu]:
    """One idle session per transport (``pcm``, ``opus``, ``webrtc``), in turn, against the
    server at ``url`` (``ws://HOST:PORT/ws``) whose process is ``server_pid``.

    Raises:
        psutil.NoSuchProcess: the server is gone.
        ConnectionError, TimeoutError: a session could not be opened.
    """
    server = psutil.Process(server_pid)
    http = url.replace("ws://", "http://", 1).rsplit("/ws", 1)[0]
    rows = []
    for t in transports:
        if t == "webrtc":
            s, c = asyncio.run(_rtc_session(http, server, seconds, lead_s))
        else:
            s, c = asyncio.run(_ws_session(url, t, server, seconds, lead_s))
        rows.append(IdleCpu(t, round(s, 1), round(c, 1)))
    return rows


def idle_cpu_lines(rows: list[IdleCpu], seconds: float) -> list[str]:
    """The rows as a Markdown table."""
    out = [f"Idle session CPU (one session, silence both ways, {seconds:.0f} s; ms of CPU per second):",
           "| transport | server | client |", "|---|---|---|"]
    out += [f"| {r.transport} | {r.server_ms_per_s:.0f} | {r.client_ms_per_s:.0f} |" for r in rows]
    return out


def codec_cpu_line(clips: list[Path]) -> str:
    """The Opus codec's CPU per session, measured here on ``clips``: the server decoding the
    user's Opus (48 kHz packets → 16 kHz) and encoding a reply (24 kHz → packets), one thread,
    as CPU milliseconds per second of audio (= thousandths of a core while audio flows)."""
    from audio.opus import OpusDecoder, OpusEncoder
    from audio.pcm import float_to_pcm16, resample
    from audio.wav import read_mono
    from clients.turn import opus_frames

    audio_s, dec_s, enc_s = 0.0, 0.0, 0.0
    for clip in clips:
        packets, _, _ = opus_frames(str(clip))
        x, sr = read_mono(clip)
        pcm24 = float_to_pcm16(resample(x, sr, 24000))
        audio_s += len(x) / sr
        t = time.process_time()
        OpusDecoder().decode(packets)
        dec_s += time.process_time() - t
        t = time.process_time()
        enc = OpusEncoder(24000)
        enc.encode(pcm24)
        enc.flush()
        enc_s += time.process_time() - t
    return (f"Opus codec CPU per session (this machine, one thread, {audio_s:.0f} s of speech): decode "
            f"{1000 * dec_s / audio_s:.1f} ms and encode {1000 * enc_s / audio_s:.1f} ms per second of audio")


def print_transport_cpu(args: argparse.Namespace, clips: list[Path], table: list[dict]) -> None:
    """After ``bench voice``'s table: the Opus codec's CPU when Opus was compared, and each
    transport's idle session CPU when ``--idle-cpu-s`` measured it."""
    if "opus" in (getattr(args, "transport", None) or []):
        print(codec_cpu_line(clips))
    idle = [r for r in table if "idle_server_cpu_ms_per_s" in r and r["sessions"] == table[0]["sessions"]]
    if idle:
        print("\n".join(idle_cpu_lines([IdleCpu(r["transport"], r["idle_server_cpu_ms_per_s"],
                                                 r["idle_client_cpu_ms_per_s"]) for r in idle], args.idle_cpu_s)))
