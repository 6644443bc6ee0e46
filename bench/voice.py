"""Voice benchmark: per-response latencies through a real server on loopback.

Starts ``voxpipe serve`` (SmolLM2 by default), then streams the English clips of the
test audio folder (tests/data/audio) at real-time pace from 1 and from N concurrent sessions, and
prints per-response medians/p95: first LLM token → first audio, first complete phrase
→ first audio, TTS real-time factor, and voice-to-voice latency (end of the user's
speech → first reply audio received by the client); per row also the turns refused with
``busy``, the share of answered turns within ``--slo-ms`` and the latest answer.

Session *k* plays the clips starting from clip *k* (rotated), so concurrent users do not
finish the same clip at the same instant; ``--lockstep`` gives every session the same
order (every turn then ends in a burst of N at once: the worst case, not a typical one).

Multi-turn mode (``--turns N`` or ``--duration S``): each session keeps ONE connection and
plays its rotated clips one after another (cycling), waiting for each turn's
``response.done`` (or ``busy``, ``turn.empty``) before it streams the next clip at real-time
pace, so its conversation history grows turn by turn. It prints the LLM TTFT and the
voice-to-voice latency per turn index (p50 over sessions, ms), and a soak summary: p50 of
the first minute against the last minute of the run, the server's prefix-cache hit rate
and its peak RSS. ``--compare-cache`` runs the same workload twice, with the server's
default and with ``--no-prefix-cache`` appended to ``--serve-args``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import TurnRow, english_clips, jsonable, turn_row
from bench.server import free_port, start_server, stop_server
from bench.transport_cpu import print_transport_cpu
from bench.voice_table import single_turn_table, turn_end
from bench.voice_variants import variants_main

if TYPE_CHECKING:
    from clients.turn import AskResult


def main(args: argparse.Namespace) -> int:
    if getattr(args, "lang", None):
        from bench.voice_lang import lang_main

        return lang_main(args)
    audio_dir = Path(args.audio_dir)
    clips = english_clips(audio_dir)
    if args.jfk_only:
        clips = [c for c in clips if "jfk" in c.name]
    if args.turns is not None or args.duration is not None:
        return multi_turn_main(args, clips)
    if args.compare_cache:
        print("--compare-cache needs --turns or --duration", file=sys.stderr)
        return 2
    args.sessions = args.sessions or [1, 4]
    if getattr(args, "variant", None):
        return variants_main(args, clips)
    table = single_turn_table(args, clips, args.serve_args.split(), log=args.server_log)
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    keys = ["first_token_to_audio", "first_phrase_to_audio", "tts_rtf", "llm_ttft", "asr", "voice_to_voice",
            "client_voice_to_voice", "transport_ms", "up_bytes_per_s", "down_bytes_per_s"]
    print(f"LLM={args.llm}, clips={len(clips)} x{args.repeat} per session; each cell: p50 / p95 (ms; RTF unitless; "
          "bytes per second of the user's audio (up) and of the reply's (down)); "
          f"within SLO: answered turns with client voice-to-voice <= {args.slo_ms:.0f} ms; turns ended by the "
          f"{turn_end(args)}")
    print("| sessions | transport | responses | busy | within SLO | max v2v | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 6))
    for row in table:
        cells = [f"{row[k][0]:.0f} / {row[k][1]:.0f}" if k != "tts_rtf" else f"{row[k][0]:.3f} / {row[k][1]:.3f}"
                 for k in keys]
        print(f"| {row['sessions']} | {row['transport']} | {row['responses']} | {row['busy']} | "
              f"{100 * row['within_slo']:.0f} % | {row['max_v2v']:.0f} | " + " | ".join(cells) + " |")
    print_transport_cpu(args, clips, table)
    return 0


# ---- multi-turn mode: one connection per session, the history grows turn by turn ----------

NO_CACHE_FLAG = "--no-prefix-cache"
"""``voxpipe serve`` option that turns the LLM's automatic prefix caching off."""
OUTPUT_RATE = 24000
"""Reply audio rate asked for (Hz), as ``voxpipe ask``'s default."""
TABLE_ROWS = 20
"""At most this many turn-index rows: more turns are grouped in equal buckets."""
SOAK_WINDOW_S = 60.0
"""The soak summary compares the first and the last this many seconds of a run."""
HIT_METRIC = "voxpipe_llm_prefix_cache_hit_tokens_total"
QUERIED_METRIC = "voxpipe_llm_prefix_cache_queried_tokens_total"
RSS_METRIC = "voxpipe_process_rss_bytes"


@dataclass(slots=True)
class ModeRun:
    """One cache mode's run: its turns, how long it lasted (s) and what ``/metrics`` said."""

    mode: str  # "cache" | "no cache"
    rows: list[TurnRow]
    span_s: float
    hit_rate: float | None = None  # hit / queried prefix-cache tokens in the run; None: not exposed or none queried
    peak_rss_mib: float | None = None  # max of the server's RSS sampled every second (MiB); None: not exposed


async def _turn(ws: Any, clip: Path, timeout_s: float) -> AskResult:
    """Play one clip on an open session at real-time pace, then ``input.end``, and wait
    for its reply (or ``busy``/``turn.empty``).

    A ``session.start`` first declares the clip's format: it keeps the conversation and
    restarts the audio position at 0, so the client's end-of-speech time is computed as
    for a single ``voxpipe ask``."""
    from clients.turn import Turn, pcm16_frames

    frames, rate, channels = pcm16_frames(str(clip))
    await ws.send(json.dumps({"type": "session.start", "sample_rate": rate, "format": "pcm16",
                              "channels": channels, "output_sample_rate": OUTPUT_RATE}))
    return await Turn(ws, output_rate=OUTPUT_RATE).run(frames, timeout_s=timeout_s)


async def run_conversation(url: str, clips: list[Path], session: int, out: list[TurnRow], *, t0: float,
                        turns: int | None, deadline: float | None, timeout_s: float = 120.0) -> None:
    """One session: one connection, ``clips`` cycled, until ``turns`` turns are taken or
    ``deadline`` (perf_counter s) has passed. A turn with no reply event, a timeout, a
    refused or closed connection ends the session (an ``error`` row)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    k = 0
    try:
        async with connect(url, max_size=None, open_timeout=10) as ws:
            while (turns is None or k < turns) and (deadline is None or time.perf_counter() < deadline):
                clip = clips[k % len(clips)]
                k += 1
                start = time.perf_counter() - t0
                res = await _turn(ws, clip, timeout_s)
                out.append(turn_row(res, session, k, start, clip.name))
                if out[-1].outcome == "error":
                    return
                if res.busy is not None:  # as a client should: wait the server's hint before speaking again
                    await asyncio.sleep(min(10.0, (res.busy.get("retry_after_ms") or 0) / 1000))
    except (TimeoutError, OSError, ConnectionClosed, InvalidHandshake) as exc:
        out.append(TurnRow(session, max(k, 1), round(time.perf_counter() - t0, 3), "error",
                           clips[(max(k, 1) - 1) % len(clips)].name, error=type(exc).__name__))


def scrape_metrics(http: str) -> str | None:
    """The server's ``/metrics`` page, or None if it did not answer."""
    try:
        with urllib.request.urlopen(http + "/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def metric_sum(body: str | None, name: str) -> float | None:
    """Sum of every sample of metric ``name`` (any labels) on a ``/metrics`` page; None
    when the page has none."""
    found = re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", body or "", re.M)
    return sum(float(v) for v in found) if found else None


def hit_rate(before: str | None, after: str | None) -> float | None:
    """Prefix-cache hit rate during a run: the increase of the hit-token counter over the
    increase of the queried-token counter between two scrapes; None when either counter is
    missing or nothing was queried."""
    vals = [metric_sum(b, m) for b in (before, after) for m in (HIT_METRIC, QUERIED_METRIC)]
    if any(v is None for v in vals):
        return None
    h0, q0, h1, q1 = (float(v or 0.0) for v in vals)
    return (h1 - h0) / (q1 - q0) if q1 > q0 else None


async def _sample_rss(http: str, stop: asyncio.Event, samples: list[float], every_s: float = 1.0) -> None:
    """Append the server's RSS (MiB) from ``/metrics`` every ``every_s`` s until ``stop``
    (scraped in a thread: the event loop keeps pacing the audio)."""
    while not stop.is_set():
        rss = metric_sum(await asyncio.to_thread(scrape_metrics, http), RSS_METRIC)
        if rss is not None:
            samples.append(rss / 2**20)
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


async def _workload(url: str, http: str, orders: list[list[Path]], turns: int | None,
                    duration_s: float | None) -> tuple[list[TurnRow], float, list[float]]:
    """Run every session at once; returns the turns, the run's length (s) and the RSS
    samples (MiB)."""
    rows: list[TurnRow] = []
    stop = asyncio.Event()
    rss: list[float] = []
    sampler = asyncio.create_task(_sample_rss(http, stop, rss))
    t0 = time.perf_counter()
    deadline = t0 + duration_s if duration_s is not None else None
    try:
        await asyncio.gather(*(run_conversation(url, order, k, rows, t0=t0, turns=turns, deadline=deadline)
                               for k, order in enumerate(orders)))
    finally:
        span = time.perf_counter() - t0
        stop.set()
        await sampler
    rows.sort(key=lambda r: (r.session, r.turn))
    return rows, span, rss


def _mode_log(log: str | None, mode: str, compare: bool) -> str | None:
    """The server log's path for one mode (``x.log`` → ``x.no-cache.log`` for the second)."""
    if not log or not compare or mode == "cache":
        return log
    p = Path(log)
    return str(p.with_name(f"{p.stem}.{mode.replace(' ', '-')}{p.suffix}"))


def run_mode(args: argparse.Namespace, mode: str, orders: list[list[Path]], extra: list[str]) -> ModeRun:
    """Start a server with ``extra`` options, run the multi-turn workload on it, stop it."""
    port = free_port()
    http = f"http://127.0.0.1:{port}"
    proc = start_server(args.llm, port, extra, log=_mode_log(args.server_log, mode, args.compare_cache))
    try:
        before = scrape_metrics(http)
        rows, span, rss = asyncio.run(_workload(f"ws://127.0.0.1:{port}/ws", http, orders, args.turns,
                                                args.duration))
        after = scrape_metrics(http)
        rss += [v / 2**20 for v in (metric_sum(after, RSS_METRIC),) if v is not None]
    finally:
        stop_server(proc)
    return ModeRun(mode, rows, span, hit_rate(before, after), max(rss) if rss else None)


def _p50(xs: list[float]) -> float:
    """Median of ``xs``; nan when empty."""
    return statistics.median(xs) if xs else float("nan")


def turn_buckets(max_turn: int, rows: int = TABLE_ROWS) -> list[tuple[int, int]]:
    """Turn-index ranges (inclusive) for the per-turn table: one per index up to ``rows``
    indices, else equal buckets of ``ceil(max_turn / rows)`` indices."""
    size = max(1, math.ceil(max_turn / rows))
    return [(lo, min(lo + size - 1, max_turn)) for lo in range(1, max_turn + 1, size)]


def _values(rows: list[TurnRow], key: str) -> list[float]:
    return [v for r in rows if r.outcome == "answered" and (v := getattr(r, key)) is not None]


def per_turn(runs: list[ModeRun]) -> list[dict[str, Any]]:
    """Per turn-index bucket and mode: p50 (over sessions and the bucket's turns) of LLM
    TTFT and client voice-to-voice (ms), and answered / all turns."""
    max_turn = max((r.turn for run in runs for r in run.rows), default=0)
    table = []
    for lo, hi in turn_buckets(max_turn):
        row: dict[str, Any] = {"turns": str(lo) if lo == hi else f"{lo}-{hi}"}
        for run in runs:
            sel = [r for r in run.rows if lo <= r.turn <= hi]
            row[run.mode] = {"llm_ttft_p50": _p50(_values(sel, "llm_ttft")),
                             "voice_to_voice_p50": _p50(_values(sel, "voice_to_voice")),
                             "answered": sum(r.outcome == "answered" for r in sel), "total": len(sel)}
        table.append(row)
    return table


def windows(rows: list[TurnRow], span_s: float, window_s: float = SOAK_WINDOW_S) -> tuple[list[TurnRow],
                                                                                         list[TurnRow], float]:
    """The turns that began in the first and in the last window of a run (by ``t_s``) and
    the window (s): ``window_s``, or half the run when the run is shorter than two windows
    (so they never overlap)."""
    w = min(window_s, span_s / 2)
    return [r for r in rows if r.t_s < w], [r for r in rows if r.t_s >= span_s - w], w


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def soak_summary(run: ModeRun, window_s: float = SOAK_WINDOW_S) -> dict[str, Any]:
    """One mode's soak row: turns by outcome; first- and last-window p50 of LLM TTFT and
    client voice-to-voice (ms) and their last/first ratios; hit rate; peak RSS (MiB)."""
    first, last, w = windows(run.rows, run.span_s, window_s)
    out: dict[str, Any] = {"mode": run.mode, "span_s": round(run.span_s, 1), "window_s": round(w, 1),
                           "turns": len(run.rows), "answered": sum(r.outcome == "answered" for r in run.rows),
                           "busy": sum(r.outcome == "busy" for r in run.rows)}
    for key, name in (("llm_ttft", "ttft"), ("voice_to_voice", "v2v")):
        a, b = _p50(_values(first, key)), _p50(_values(last, key))
        out |= {f"{name}_first_p50": a, f"{name}_last_p50": b, f"{name}_last_over_first": _ratio(b, a)}
    return out | {"prefix_cache_hit_rate": run.hit_rate, "peak_rss_mib": run.peak_rss_mib}


def _ms(x: float, fmt: str = ".0f") -> str:
    """A table cell: ``x`` in ``fmt``, an en dash for nan (nothing to measure)."""
    return "–" if math.isnan(x) else format(x, fmt)


def format_per_turn(table: list[dict[str, Any]], modes: list[str]) -> str:
    """The per-turn table (Markdown): per mode, TTFT p50, v2v p50 (ms) and answered/all."""
    head = "| turn | " + " | ".join(f"{m} TTFT p50 | {m} v2v p50 | {m} answered" for m in modes) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * len(modes))]
    for row in table:
        cells = [f"{_ms(row[m]['llm_ttft_p50'])} | {_ms(row[m]['voice_to_voice_p50'])} | "
                 f"{row[m]['answered']}/{row[m]['total']}" for m in modes]
        lines.append(f"| {row['turns']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_summary(rows: list[dict[str, Any]]) -> str:
    """The soak summary (Markdown): one row per mode (ms; ratios unitless; RSS MiB)."""
    lines = ["| mode | window s | turns | answered | busy | TTFT p50 first / last | TTFT last/first | "
             "v2v p50 first / last | v2v last/first | prefix-cache hit rate | peak RSS MiB |",
             "|" + "---|" * 11]
    for s in rows:
        hit = "n/a" if s["prefix_cache_hit_rate"] is None else f"{100 * s['prefix_cache_hit_rate']:.1f} %"
        rss = "n/a" if s["peak_rss_mib"] is None else f"{s['peak_rss_mib']:.0f}"
        cells = [s["mode"], f"{s['window_s']:.0f}", str(s["turns"]), str(s["answered"]), str(s["busy"])]
        for name in ("ttft", "v2v"):
            cells += [f"{_ms(s[f'{name}_first_p50'])} / {_ms(s[f'{name}_last_p50'])}",
                      _ms(s[f"{name}_last_over_first"], ".2f")]
        lines.append("| " + " | ".join([*cells, hit, rss]) + " |")
    return "\n".join(lines)


def _serve_knows(option: str) -> bool:
    """Whether this ``voxpipe serve`` has ``option`` (its ``--help`` names it)."""
    out = subprocess.run([sys.executable, "-m", "cli", "serve", "--help"], capture_output=True, text=True,
                         timeout=120)
    return option in out.stdout


def _modes(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(label, extra server options) per run: the default, then ``--no-prefix-cache`` when
    comparing. A lone run is labelled ``no cache`` if ``--serve-args`` already turns it off."""
    base = args.serve_args.split()
    if args.compare_cache:
        return [("cache", base), ("no cache", [*base, NO_CACHE_FLAG])]
    return [("no cache" if NO_CACHE_FLAG in base else "cache", base)]


def multi_turn_main(args: argparse.Namespace, clips: list[Path]) -> int:
    """``bench voice --turns N`` / ``--duration S`` [``--compare-cache``]: print the
    per-turn table and the soak summary (or one JSON object with ``--json``)."""
    sessions = args.sessions or [4]
    if len(sessions) != 1:
        print("multi-turn mode takes one --sessions value", file=sys.stderr)
        return 2
    n = sessions[0]
    if args.compare_cache and not _serve_knows(NO_CACHE_FLAG):
        print(f"--compare-cache needs 'voxpipe serve {NO_CACHE_FLAG}', which this version does not have",
              file=sys.stderr)
        return 2
    orders = [clips if args.lockstep else clips[k % len(clips):] + clips[:k % len(clips)] for k in range(n)]
    runs = [run_mode(args, mode, orders, extra) for mode, extra in _modes(args)]
    table, summary = per_turn(runs), [soak_summary(r) for r in runs]
    modes = [r.mode for r in runs]
    if args.json:
        print(json.dumps(jsonable({"llm": args.llm, "sessions": n, "turns": args.turns, "duration_s": args.duration,
                                    "per_turn": table, "summary": summary,
                                    "rows": {r.mode: [asdict(t) for t in r.rows] for r in runs}}), indent=1))
        return 0
    what = f"{args.turns} turns" if args.turns is not None else f"turns for {args.duration:g} s"
    print(f"LLM={args.llm}, {n} session(s) x {what}, one connection each (the history grows); "
          f"per turn index: p50 over sessions (ms), answered / all turns")
    print(format_per_turn(table, modes))
    print()
    print("Soak: p50 (ms) of the turns begun in the first vs the last window of the run (60 s, or half a "
          "shorter run); "
          "hit rate: the server's prefix-cache hit tokens / queried tokens during the run")
    print(format_summary(summary))
    return 0
