"""The abusive (or neighbouring) session of ``voxpipe bench edge`` (:mod:`bench.edge`): the
speech it streams, how it sends (paced at a multiple of real time, or 4 MiB frames back to
back), and the spawned process it runs in, which reports an :class:`AbuserStats`."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from audio.pcm import RATE

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.synchronize import Event as MpEvent

    import numpy as np

BIG_RATE = 8000
"""``big_frames`` declares PCM16 at this rate: a 4 MiB frame then holds the most audio."""
BIG_FRAME_BYTES = 4 * 1024 * 1024 - 4096
"""Just under the server's largest message (``ServerConfig.max_message_bytes``, 4 MiB)."""
FRAME_S = 0.02
"""Streamed audio frames: 20 ms (``clients.turn.FRAME_MS``)."""
PAUSE_S = 3.0
"""Silence after each clip of the abuser stream (audio seconds)."""
OUTPUT_RATE = 24000
"""Reply audio rate asked for (Hz), as ``voxpipe ask``'s default."""
MIN_SLEEP_S = 0.005
"""A paced sender sleeps at least this long, then sends every frame that is due."""
RECONNECT_S = 0.5
"""An abuser whose session the server ended opens a new one after this long."""


@dataclass(slots=True)
class AbuserStats:
    """What the abusive (or neighbouring) session sent and got back."""

    kind: str  # "stream" | "big"
    speed: float | None = None  # the stream's target pace (× real time); None: as fast as sends go
    seconds: float = 0.0  # how long it sent (s)
    messages: int = 0  # binary messages whose send completed
    audio_sent_s: float = 0.0  # audio in them (s)
    audio_heard_s: float = 0.0  # latest audio_ms of a speech.started/stopped (s): the server processed ≥ this
    max_send_ms: float = 0.0  # the longest single send (ms): a server that stops reading shows here
    replies: int = 0  # response.done received
    errors: dict[str, int] = field(default_factory=dict)  # error events by code
    busy: dict[str, int] = field(default_factory=dict)  # busy events by reason
    closes: dict[str, int] = field(default_factory=dict)  # connections the server ended, by "code reason"
    connections: int = 0  # sessions it opened (more than 1: the server ended one and it came back)
    heard_base_s: float = 0.0  # audio heard on its earlier connections (s)
    failure: str | None = None  # the abuser could not run (its exception)

    @property
    def pace(self) -> float:
        """Audio sent per wall-clock second (× real time); nan when it never ran."""
        return self.audio_sent_s / self.seconds if self.seconds > 0 else float("nan")


# ---- audio ---------------------------------------------------------------------------


def abuser_stream(paths: list[Path], rate: int, pause_s: float = PAUSE_S) -> bytes:
    """One loop of the abuser's speech: each clip (mono, resampled to ``rate``) followed by
    ``pause_s`` of silence, as PCM16 little-endian bytes."""
    import numpy as np

    from audio.pcm import float_to_pcm16, resample
    from audio.wav import read_mono

    parts: list[np.ndarray] = []
    for p in paths:
        x, r = read_mono(p)
        parts += [resample(x, r, rate), np.zeros(int(round(pause_s * rate)), np.float32)]
    return float_to_pcm16(np.concatenate(parts))


def stream_frames(loop: bytes, rate: int, frame_s: float = FRAME_S) -> list[bytes]:
    """``loop`` cut into ``frame_s`` frames; the last one padded with silence to full size."""
    step = int(round(rate * frame_s)) * 2
    loop += bytes(-len(loop) % step)
    return [loop[i:i + step] for i in range(0, len(loop), step)]


def big_frame(loop: bytes, size: int = BIG_FRAME_BYTES) -> bytes:
    """``loop`` repeated to exactly ``size`` bytes (rounded down to whole PCM16 samples)."""
    size -= size % 2
    return (loop * (size // len(loop) + 1))[:size]


# ---- the abuser (its own process) ------------------------------------------------------


def _count(d: dict[str, int], key: str) -> None:
    d[key] = d.get(key, 0) + 1


async def _read_all(ws: Any, stats: AbuserStats) -> None:
    """Read and count everything the server sends, until the connection closes."""
    from websockets.exceptions import ConnectionClosed

    try:
        async for msg in ws:
            if isinstance(msg, bytes):
                continue
            ev = json.loads(msg)
            kind = ev.get("type")
            if kind in ("speech.started", "speech.stopped") and isinstance(ev.get("audio_ms"), int):
                stats.audio_heard_s = max(stats.audio_heard_s, stats.heard_base_s + ev["audio_ms"] / 1000)
            elif kind == "response.done":
                stats.replies += 1
            elif kind == "error":
                _count(stats.errors, str(ev.get("code")))
            elif kind == "busy":
                _count(stats.busy, str(ev.get("reason")))
    except ConnectionClosed:
        pass


async def _send_timed(ws: Any, data: bytes, stats: AbuserStats, rate: int) -> None:
    t = time.perf_counter()
    await ws.send(data)
    stats.max_send_ms = max(stats.max_send_ms, (time.perf_counter() - t) * 1000)
    stats.messages += 1
    stats.audio_sent_s += len(data) / (2 * rate)


async def _paced(ws: Any, frames: list[bytes], speed: float, stats: AbuserStats) -> None:
    """Send ``frames`` (cycled) at ``speed`` × real time: wake at least every
    ``MIN_SLEEP_S``, send what is due. Behind schedule (a send blocked), it sends back to
    back until it has caught up — as a client that keeps trying would."""
    t0 = time.perf_counter()
    i = 0
    while True:
        due = int((time.perf_counter() - t0) * speed / FRAME_S) + 1
        if i >= due:
            await asyncio.sleep(max(MIN_SLEEP_S, t0 + i * FRAME_S / speed - time.perf_counter()))
            continue
        await _send_timed(ws, frames[i % len(frames)], stats, RATE)
        i += 1
        if i % 50 == 0:  # a send with room in the buffer does not yield: let the reader run
            await asyncio.sleep(0)


async def _back_to_back(ws: Any, frame: bytes, stats: AbuserStats) -> None:
    while True:
        await _send_timed(ws, frame, stats, BIG_RATE)
        await asyncio.sleep(0)


async def wait_for_event(stop: MpEvent) -> None:
    """Return once ``stop`` (a multiprocessing Event: nothing to await) is set."""
    while not stop.is_set():  # noqa: ASYNC110 — polled: a thread blocked in stop.wait() would outlive the loop
        await asyncio.sleep(0.05)


async def _one_connection(ws: Any, kind: str, speed: float, payload: Any, stats: AbuserStats,
                          stopper: asyncio.Task, on_ready: Any) -> None:
    """Abuse one connection until ``stopper`` is done or the server ends it (counted in
    ``stats.closes``)."""
    rate = BIG_RATE if kind == "big" else RATE
    await ws.send(json.dumps({"type": "session.start", "sample_rate": rate, "format": "pcm16", "channels": 1,
                              "output_sample_rate": OUTPUT_RATE}))
    reader = asyncio.create_task(_read_all(ws, stats))
    sender = asyncio.create_task(_paced(ws, payload, speed, stats) if kind == "stream"
                                 else _back_to_back(ws, payload, stats))
    if on_ready is not None:
        on_ready()
    try:
        await asyncio.wait({reader, sender, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (reader, sender):
            t.cancel()
        await asyncio.gather(reader, sender, return_exceptions=True)
    if not stopper.done():  # the server ended it (a send or the reader saw the close)
        err = sender.exception() if sender.done() and not sender.cancelled() else None
        code = ws.close_code if ws.close_code is not None else type(err).__name__
        _count(stats.closes, f"{code} {ws.close_reason or ''}".strip())


async def abuse(url: str, kind: str, speed: float, clips: list[Path], stop: MpEvent,
                on_ready: Any = None) -> AbuserStats:
    """Run one abusive client until ``stop`` is set: a session that the server ends is
    replaced by a new one after ``RECONNECT_S`` (as a determined abuser would); calls
    ``on_ready()`` once it has started sending. Returns what it sent and got.

    Raises:
        OSError, InvalidHandshake, TimeoutError: its first connection failed.
    """
    from websockets.asyncio.client import connect
    from websockets.exceptions import InvalidHandshake

    rate = BIG_RATE if kind == "big" else RATE
    loop = abuser_stream(clips, rate)
    payload = stream_frames(loop, rate) if kind == "stream" else big_frame(loop)
    stats = AbuserStats(kind, speed=speed if kind == "stream" else None)
    stopper = asyncio.create_task(wait_for_event(stop))
    t0 = time.perf_counter()
    first = True
    try:
        while not stopper.done():
            try:
                # no keepalive pings of its own: a server too busy to answer one in time must
                # not make the abuser hang up
                ws = await connect(url, max_size=None, open_timeout=10, close_timeout=2, ping_interval=None)
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                if first:
                    raise
                _count(stats.closes, f"connect failed: {type(exc).__name__}")
                await asyncio.wait({stopper}, timeout=RECONNECT_S)
                continue
            stats.connections += 1
            stats.heard_base_s = stats.audio_heard_s  # a new session's audio_ms starts at 0
            try:
                await _one_connection(ws, kind, speed, payload, stats, stopper, on_ready if first else None)
            finally:
                first = False
                try:
                    await asyncio.wait_for(ws.close(), 3)
                except Exception:  # noqa: BLE001 — a throttled socket may not take the close frame: drop it
                    ws.transport.abort()
            if not stopper.done():
                await asyncio.wait({stopper}, timeout=RECONNECT_S)
    finally:
        stats.seconds = time.perf_counter() - t0
        stopper.cancel()
    return stats


def abuser_main(url: str, kind: str, speed: float, clips: list[str], stop: MpEvent, conn: Connection) -> None:
    """The abuser process: ``{"ready": true}`` on ``conn`` once sending, then its stats
    (a dict) — or ``{"failure": ...}`` when it could not run."""
    try:
        stats = asyncio.run(abuse(url, kind, speed, [Path(c) for c in clips], stop,
                                  on_ready=lambda: conn.send({"ready": True})))
        conn.send({"stats": asdict(stats)})
    except Exception as exc:  # noqa: BLE001 — reported in the table
        conn.send({"failure": f"{type(exc).__name__}: {exc}"[:200]})
    finally:
        conn.close()


class AbuserProcess:
    """The abuser in a spawned process (no GIL, no event loop shared with the victim)."""

    def __init__(self, url: str, kind: str, speed: float, clips: list[Path]) -> None:
        ctx = mp.get_context("spawn")
        self.kind = kind
        self._failure: str | None = None  # why it could not start
        self.stop = ctx.Event()
        self.conn, child = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=abuser_main, args=(url, kind, speed, [str(c) for c in clips], self.stop, child),
                                name=f"voxpipe-edge-{kind}", daemon=True)
        self.proc.start()
        child.close()

    def _recv(self, timeout_s: float) -> dict:
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (EOFError, OSError):
            return {"failure": f"the abuser process exited (code {self.proc.exitcode})"}
        return {"failure": f"no answer from the abuser within {timeout_s:.0f} s"}

    async def ready(self, timeout_s: float = 60.0) -> str | None:
        """Wait until it sends; None when it does, else why not."""
        msg = await asyncio.to_thread(self._recv, timeout_s)
        if msg.get("ready"):
            return None
        self._failure = msg.get("failure") or "no stats"
        return self._failure

    async def finish(self, timeout_s: float = 30.0) -> AbuserStats:
        """Stop it and collect its stats."""
        self.stop.set()
        msg: dict[str, Any] = ({"failure": self._failure} if self._failure
                               else await asyncio.to_thread(self._recv, timeout_s))
        await asyncio.to_thread(self.proc.join, 10)
        if self.proc.is_alive():
            self.proc.terminate()
            await asyncio.to_thread(self.proc.join, 5)
        if "stats" in msg:
            s = msg["stats"]
            return AbuserStats(**s)
        return AbuserStats(self.kind, failure=str(msg.get("failure")))
