"""Silent-session benchmark: what do connected sessions that send only silence cost?

A person with the page open and nobody talking still streams microphone audio: every
20 ms frame is decoded, resampled and run through the VAD. For each scenario this starts
a FRESH ``voxpipe serve`` (SmolLM2 by default; ``--serve-args`` passes options through),
opens a *victim* session (one uncounted warm-up turn), then a *crowd* of ``--sessions``
sessions in another process, each streaming 20 ms PCM16 frames at 16 kHz in real time:
digital silence, or white noise at ``--noise-dbfs`` (a quiet room through a real
microphone). After ``--lead-in-s`` it samples the server process's CPU time (all its
threads, psutil) over ``--measure-s`` while only the crowd streams — the cost of the
silent sessions, as % of one core — and then runs ``--turns`` victim turns (the same
spoken turns as ``voxpipe bench edge``'s victim) while the crowd goes on: voice-to-voice
p50/p95 and its ratio to the scenario without a crowd.

Scenarios: ``none`` (no crowd) and ``silent_N``; ``--compare-gate`` repeats both with
``--no-vad-gate`` (Silero on every window) to show what the level gate saves.

Run: ``voxpipe bench silent`` (about 4 minutes on 2 cores; 8 with ``--compare-gate``).
A measurement, not a test: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from audio.pcm import RATE
from bench.edge import VICTIM_CLIPS, victim_turn, victim_turns
from bench.edge_abuser import wait_for_event
from bench.load import pct
from bench.server import free_port, start_server, stop_server

if TYPE_CHECKING:
    from multiprocessing.synchronize import Event as MpEvent

FRAME_SAMPLES = 320
"""20 ms at 16 kHz: what ``voxpipe mic`` and the web page send."""


@dataclass(slots=True)
class SilentResult:
    """One scenario's outcome."""

    name: str
    sessions: int
    gate: bool
    cpu_pct: float
    turns: int
    answered: int
    v2v_ms: list[float]
    crowd_events: int = 0
    crowd_failure: str | None = None


def crowd_frame(noise_dbfs: float | None, seed: int) -> bytes:
    """One second of the crowd's audio as PCM16 bytes: zeros, or white noise at
    ``noise_dbfs`` RMS (dBFS)."""
    if noise_dbfs is None:
        return bytes(2 * RATE)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(RATE) * (10 ** (noise_dbfs / 20))
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def _silent_session(url: str, second: bytes, stop: asyncio.Task, counts: dict[str, int]) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, open_timeout=30, close_timeout=2) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": RATE, "format": "pcm16", "channels": 1}))

        async def read() -> None:
            async for _ in ws:
                counts["events"] += 1

        reader = asyncio.create_task(read())
        t0, i, step = time.perf_counter(), 0, FRAME_SAMPLES * 2
        try:
            while not stop.done():
                delay = t0 + i * 0.02 - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                off = (i * step) % len(second)
                await ws.send(second[off:off + step])
                i += 1
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


async def _crowd(url: str, n: int, noise_dbfs: float | None, stop_ev: MpEvent, conn: Any) -> dict:
    stop = asyncio.create_task(wait_for_event(stop_ev))
    counts = {"events": 0}
    tasks = [asyncio.create_task(_silent_session(url, crowd_frame(noise_dbfs, k), stop, counts)) for k in range(n)]
    await asyncio.sleep(1.0)
    conn.send({"ready": True})
    done, _ = await asyncio.wait([*tasks, stop], return_when=asyncio.FIRST_COMPLETED)
    failure = None
    for t in done:
        if t is not stop and t.exception() is not None:
            failure = f"{type(t.exception()).__name__}: {t.exception()}"[:200]
    await stop
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"events": counts["events"], "failure": failure}


def crowd_main(url: str, n: int, noise_dbfs: float | None, stop: MpEvent, conn: Any) -> None:
    """The crowd process: ``{"ready": True}`` once streaming, then ``{"events", "failure"}``."""
    try:
        conn.send(asyncio.run(_crowd(url, n, noise_dbfs, stop, conn)))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        conn.send({"events": 0, "failure": f"{type(exc).__name__}: {exc}"[:200]})


def _cpu_pct(pid: int, seconds: float) -> float:
    """CPU time of process ``pid`` (all threads) over ``seconds`` of wall time, % of one core."""
    import psutil

    p = psutil.Process(pid)
    c0, t0 = sum(p.cpu_times()[:2]), time.perf_counter()
    time.sleep(seconds)
    return 100.0 * (sum(p.cpu_times()[:2]) - c0) / (time.perf_counter() - t0)


async def run_on(url: str, pid: int, name: str, n: int, gate: bool, args: argparse.Namespace,
                 victim: list[Path]) -> SilentResult:
    """Run one scenario against a ready server (``pid``: its process)."""
    from websockets.asyncio.client import connect

    ctx = mp.get_context("spawn")
    async with connect(url, max_size=None, open_timeout=10, close_timeout=2) as ws:
        await victim_turn(ws, victim[0], args.turn_timeout)  # warm-up, uncounted
        stop, (rx, tx) = ctx.Event(), ctx.Pipe(duplex=False)
        proc = ctx.Process(target=crowd_main, args=(url, n, args.noise_dbfs, stop, tx), daemon=True) if n else None
        crowd: dict[str, Any] = {"events": 0, "failure": None}
        try:
            if proc is not None:
                proc.start()
                msg = await asyncio.to_thread(lambda: rx.recv() if rx.poll(120) else {"failure": "crowd not ready"})
                if not msg.get("ready"):
                    crowd = msg
            await asyncio.sleep(args.lead_in_s)
            cpu = await asyncio.to_thread(_cpu_pct, pid, args.measure_s)
            rows = await victim_turns(ws, victim, args.turns, args.turn_timeout, time.perf_counter() + 600, first=1)
        finally:
            if proc is not None:
                stop.set()
                if crowd.get("failure") is None:
                    crowd = await asyncio.to_thread(lambda: rx.recv() if rx.poll(30) else {"failure": "no stats"})
                proc.join(10)
                if proc.is_alive():
                    proc.terminate()
    v2v = [r.voice_to_voice for r in rows if r.outcome == "answered" and r.voice_to_voice is not None]
    return SilentResult(name, n, gate, round(cpu, 1), args.turns, len(v2v), v2v, int(crowd.get("events") or 0),
                        crowd.get("failure"))


def run_scenario(args: argparse.Namespace, name: str, n: int, gate: bool, victim: list[Path]) -> SilentResult:
    """Start a fresh server, run one scenario on it, stop it."""
    port = free_port()
    extra = args.serve_args.split() + ([] if gate else ["--no-vad-gate"])
    proc = start_server(args.llm, port, extra)
    try:
        return asyncio.run(run_on(f"ws://127.0.0.1:{port}/ws", proc.pid, name, n, gate, args, victim))
    finally:
        stop_server(proc)


def summarize(results: list[SilentResult]) -> list[dict[str, Any]]:
    """Table rows: each scenario with p50/p95 and the ratio of its p50 to the crowd-less
    scenario's with the same gate setting."""
    base = {r.gate: statistics.median(r.v2v_ms) for r in results if r.sessions == 0 and r.v2v_ms}
    out = []
    for r in results:
        p50 = statistics.median(r.v2v_ms) if r.v2v_ms else None
        b = base.get(r.gate)
        out.append({"scenario": r.name, "silent_sessions": r.sessions, "vad_gate": r.gate, "server_cpu_pct": r.cpu_pct,
                    "answered": f"{r.answered}/{r.turns}", "v2v_p50_ms": None if p50 is None else round(p50),
                    "v2v_p95_ms": round(pct(r.v2v_ms, 95)) if r.v2v_ms else None,
                    "p50_ratio": round(p50 / b, 2) if b and p50 is not None else None, "crowd_events": r.crowd_events,
                    "crowd_failure": r.crowd_failure})
    return out


def _num(x: Any) -> str:
    return "-" if x is None else str(x)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The printed table."""
    head = (f"{'scenario':<12} {'silent':>6} {'gate':>5} {'server CPU % (1 core)':>22} {'answered':>9} "
            f"{'v2v p50':>8} {'p95':>6} {'ratio':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "" if r["p50_ratio"] is None else f"{r['p50_ratio']:.2f}"
        lines.append(f"{r['scenario']:<12} {r['silent_sessions']:>6} {'on' if r['vad_gate'] else 'off':>5} "
                     f"{r['server_cpu_pct']:>22.1f} {r['answered']:>9} {_num(r['v2v_p50_ms']):>8} "
                     f"{_num(r['v2v_p95_ms']):>6} {ratio:>6}")
        if r["crowd_failure"]:
            lines.append(f"  crowd failed: {r['crowd_failure']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default="smollm2")
    p.add_argument("--sessions", type=int, default=20, help="silent sessions in the crowd (20)")
    p.add_argument("--turns", type=int, default=6, help="victim turns counted per scenario (6)")
    p.add_argument("--measure-s", type=float, default=20.0, help="CPU sampled over this long, crowd only (20)")
    p.add_argument("--lead-in-s", type=float, default=3.0, help="the crowd streams this long before sampling")
    p.add_argument("--noise-dbfs", type=float, default=None,
                   help="the crowd sends white noise at this RMS level (dBFS, e.g. -65) instead of zeros")
    p.add_argument("--compare-gate", action="store_true", help="repeat every scenario with --no-vad-gate")
    p.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options")
    p.add_argument("--turn-timeout", type=float, default=30.0)
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    """``voxpipe bench silent``: run the scenarios, print the table (or JSON)."""
    victim = [Path(args.audio_dir) / c for c in VICTIM_CLIPS]
    t0 = time.perf_counter()
    results = []
    for gate in ((True, False) if args.compare_gate else (True,)):
        for n in (0, args.sessions):
            name = "none" if n == 0 else f"silent_{n}"
            results.append(run_scenario(args, name, n, gate, victim))
            if not args.json:
                print(f"{name} (gate {'on' if gate else 'off'}): done ({time.perf_counter() - t0:.0f} s)", flush=True)
    rows = summarize(results)
    if args.json:
        print(json.dumps({"llm": args.llm, "noise_dbfs": args.noise_dbfs, "scenarios": rows,
                          "results": [asdict(r) for r in results]}, indent=1))
        return 0
    what = "digital silence" if args.noise_dbfs is None else f"white noise at {args.noise_dbfs:g} dBFS"
    print(f"\nLLM={args.llm}, a fresh server per scenario; crowd: {args.sessions} sessions streaming {what} in "
          f"real time (20 ms frames); server CPU over {args.measure_s:g} s with only the crowd streaming; victim: "
          f"{args.turns} spoken turns while the crowd goes on")
    print(format_table(rows))
    print(f"runtime {time.perf_counter() - t0:.0f} s")
    return 0
