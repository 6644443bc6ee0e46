"""The single-turn voice table (``voxpipe bench voice``, and one run per ``--variant``): one
server, the clips played from 1 and from N concurrent sessions, one ``voxpipe ask`` per clip,
a row of per-response p50 / p95 per sessions value."""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path

from bench.server import free_port, start_server, stop_server


async def _session(url: str, clips: list[Path], out: list[dict]) -> None:
    """One session: a ``voxpipe ask`` per clip, in turn; appends to ``out`` a row per refused
    turn (``busy``, ``clip``) and per answered one (its ``timings_ms``, the client's
    voice-to-voice, ``clip``)."""
    from clients.client import ask

    for clip in clips:
        res = await ask(str(clip), url=url, timeout_s=120)
        done = [e for e in res.events if e["type"] == "response.done"]
        if res.busy is not None:
            out.append({"busy": res.busy.get("reason"), "clip": clip.name})
        if not done:
            continue
        t = dict(done[-1]["timings_ms"])
        t["client_voice_to_voice"] = res.timings_ms.get("voice_to_voice")
        t["clip"] = clip.name
        out.append(t)


def _stat(rows: list[dict], key: str) -> tuple[float, float]:
    """(p50, p95) of ``key`` over the rows that have it; (nan, nan) when none does."""
    xs = sorted(r[key] for r in rows if r.get(key) is not None)
    if not xs:
        return float("nan"), float("nan")
    return statistics.median(xs), xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


ROW_KEYS = ("first_audio", "first_token_to_audio", "first_phrase_to_audio", "tts_rtf", "llm_ttft", "asr",
            "voice_to_voice", "client_voice_to_voice")
"""Per-turn timings (``response.done``'s ``timings_ms``, and the client's voice-to-voice) a
row summarizes as (p50, p95)."""


def single_turn_table(args: argparse.Namespace, clips: list[Path], extra: list[str],
                      log: str | None = None) -> list[dict]:
    """Start ``voxpipe serve --llm args.llm EXTRA``, play ``clips`` × ``args.repeat`` from each
    of ``args.sessions`` concurrent sessions (one row per value), stop the server.

    Returns:
        one dict per sessions value: ``sessions``, ``responses``, ``busy``, ``within_slo``
        (share of answered turns with client voice-to-voice <= ``args.slo_ms``), ``max_v2v``
        (ms) and (p50, p95) of each of :data:`ROW_KEYS` (ms; ``tts_rtf`` unitless).

    Raises:
        RuntimeError: the server exited or was not ready in 600 s.
    """
    port = free_port()
    proc = start_server(args.llm, port, extra, log=log)
    url = f"ws://127.0.0.1:{port}/ws"
    table = []
    try:
        for n in args.sessions:
            rows: list[dict] = []
            per = clips * args.repeat

            async def run(n: int, per: list[Path], rows: list[dict]) -> None:
                orders = [per if args.lockstep else per[k % len(per):] + per[:k % len(per)] for k in range(n)]
                await asyncio.gather(*(_session(url, order, rows) for order in orders))

            asyncio.run(run(n, per, rows))
            answered = [r for r in rows if "busy" not in r]
            v2v = [r["client_voice_to_voice"] for r in answered if r.get("client_voice_to_voice") is not None]
            row = {"sessions": n, "responses": len(answered), "busy": len(rows) - len(answered),
                   "within_slo": sum(x <= args.slo_ms for x in v2v) / len(v2v) if v2v else float("nan"),
                   "max_v2v": max(v2v, default=float("nan"))}
            for key in ROW_KEYS:
                row[key] = _stat(answered, key)
            table.append(row)
    finally:
        stop_server(proc)
    return table
