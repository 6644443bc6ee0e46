"""What one open session costs in CPU per transport while nobody talks (issue 34).

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

import asyncio
import json
import time
from dataclasses import dataclass

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
