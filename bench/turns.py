"""``voxpipe bench turns``: turn-taking through a real server, per server configuration (a
row) and class of case (:mod:`bench.turn_set`: complete turns, thinking pauses, backchannels,
interruptions, noise bursts).

Per row it starts ``voxpipe serve`` with the row's flags (SmolLM2 by default, as the latency
benches), plays each case on its own connection as an open microphone — 20 ms PCM16 frames
at 16 kHz paced by the clock, silence after the speech — and, for a case with a burst, sends
the burst a seeded 0.5–1.5 s after the reply's first audio arrives. It measures from the
wire events (:mod:`bench.turn_metrics` defines each measure) and prints one table: a line per
row and class. A row whose server does not start is reported as failed with the server's last
log line; the other rows still run.

Cases run ``--concurrency`` at a time (default 3, the first ones 2.5 s apart, each on its own
session), to keep a full run short. A case's costly moments (its end of turn, its reply's
first phrase) are short and rarely meet another's; ``--concurrency 1`` plays one case at a
time, to check that the latencies agree (docs/BENCHMARKS.md has the comparison).

Every row's server runs with :data:`BASE_FLAGS`; the cases with a burst ask for a storyteller's
reply (:data:`LONG_REPLY_PROMPT`) so that it is still playing when the burst comes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from audio.pcm import float_to_pcm16
from bench.common import jsonable
from bench.server import free_port, start_server, stop_server
from bench.turn_metrics import CaseLog, case_result, summarize, the_reply
from bench.turn_set import CLASSES, RATE, Case, build_set

ROWS = {"today": "--end-of-turn silence --no-backchannels --resume-after-ms 0",
        "silence-800": "--end-of-turn silence --no-backchannels --resume-after-ms 0 --end-silence-ms 800",
        "smart-turn": "--end-of-turn smart-turn"}
"""Server configurations: today's silence rule (500 ms), a fixed 800 ms silence, and the
semantic end of turn with backchannels and false-interruption resume (their defaults)."""
FRAME_S = 0.02
OUTPUT_RATE = 24000
ANSWER_TIMEOUT_S = 20.0
"""How long after the true end of speech a case waits for its reply's first audio (s)."""
SETTLE_S = 2.5
"""After a burst ends, how long a case waits for the reply to be paused, resumed or cancelled (s)."""
STAGGER_S = 2.5
"""The first ``--concurrency`` cases start this far apart (s)."""
LONG_REPLY_PROMPT = ("You are a storyteller. Whatever the person says, tell a story about it in five or six "
                     "sentences.")
"""The system prompt of the cases with a burst, so that their reply is still being sent when
the burst comes: the server's default asks for one or two short sentences, often sent in full
before a burst 0.5–1.5 s into the reply (a reply is sent up to 1 s ahead of playback, and one
fully sent can no longer be stopped)."""
BASE_FLAGS = ["--llm-examples", "[]", "--no-admission"]
"""Every row's server runs without the few-shot examples (with them the small model answers in
one short sentence whatever the system prompt asks) and without admission control (a turn
refused with ``busy`` says nothing about turn-taking)."""


class _Stream:
    """The client side of one case: paced frames out (speech, then silence or the burst),
    events in, until :attr:`finished` says the case is decided."""

    def __init__(self, case: Case, ws: Any) -> None:
        self.case, self.ws = case, ws
        self.log = CaseLog(case.cls, case.name, last_start_ms=case.last_start_s * 1000,
                           pause_end_ms=case.pause[1] * 1000 if case.pause else None)
        self.pcm = float_to_pcm16(case.speech)
        self.burst = float_to_pcm16(case.burst) if case.burst is not None else b""
        self.burst_due: float | None = None
        self.burst_end: float | None = None
        self.finished = asyncio.Event()

    async def send(self) -> None:
        step = int(RATE * FRAME_S) * 2
        t0, i, b = time.perf_counter(), 0, None
        end_frame = int(self.case.true_end_s / FRAME_S)
        while True:
            delay = t0 + i * FRAME_S - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            if i * step < len(self.pcm):
                frame = self.pcm[i * step:(i + 1) * step]
            elif b is None and self.burst_due is not None and now >= self.burst_due:
                b = i
                self.log.burst_start, self.log.burst_pos_ms = now, i * FRAME_S * 1000
                self.log.burst_word = now + self.case.burst_onset_s
                frame = self.burst[:step]
            elif b is not None and (i - b) * step < len(self.burst):
                frame = self.burst[(i - b) * step:(i - b + 1) * step]
            else:
                if b is not None and self.burst_end is None:
                    self.burst_end = now
                frame = b""
            frame += bytes(step - len(frame))
            await self.ws.send(frame)
            if i == end_frame:  # the frame holding the last speech sample went out: its place in it
                self.log.true_end = time.perf_counter() + self.case.true_end_s - i * FRAME_S
            i += 1
            self._check(time.perf_counter())

    async def receive(self) -> None:
        from audio.frames import parse_audio_frame

        async for msg in self.ws:
            now = time.perf_counter()
            if isinstance(msg, bytes):
                rid, _ = parse_audio_frame(msg)
                ts = self.log.audio.setdefault(rid, [now, now])
                ts[1] = now
                if self.case.burst is not None and self.burst_due is None and self.log.true_end is not None \
                        and ts[0] >= self.log.true_end:
                    self.burst_due = ts[0] + self.case.burst_delay_s
            else:
                self.log.events.append((now, json.loads(msg)))
            self._check(now)

    def _check(self, now: float) -> None:
        """Set :attr:`finished` once the case is decided (or timed out)."""
        log, end = self.log, self.log.true_end
        if end is None:
            return
        if now > end + ANSWER_TIMEOUT_S + (SETTLE_S + 3.0 if self.case.burst is not None else 0.0):
            self.finished.set()
            return
        rid = the_reply(log)
        if rid is None:
            if any(e.get("type") in ("busy", "turn.empty") for t, e in log.events if t >= end):
                self.finished.set()
            return
        if self.case.burst is None:
            self.finished.set()
            return
        kinds = {e.get("type") for _, e in log.events if e.get("response_id") == rid}
        if "response.cancelled" in kinds or ("response.done" in kinds and log.burst_start is None):
            self.finished.set()
        elif self.burst_end is not None and now >= self.burst_end + SETTLE_S and (
                "response.paused" not in kinds or "response.resumed" in kinds or now >= self.burst_end + 2 * SETTLE_S):
            self.finished.set()


async def run_case(url: str, case: Case) -> CaseLog:
    """Play one case on a new connection; what the client saw. An exception ends the case
    (its ``error`` says which)."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    stream: _Stream | None = None
    try:
        async with connect(url, max_size=None, open_timeout=30) as ws:
            start = {"type": "session.start", "sample_rate": RATE, "format": "pcm16", "channels": 1,
                     "output_sample_rate": OUTPUT_RATE}
            if case.burst is not None:
                start["system_prompt"] = LONG_REPLY_PROMPT
            await ws.send(json.dumps(start))
            stream = _Stream(case, ws)
            tasks = [asyncio.create_task(stream.send()), asyncio.create_task(stream.receive())]
            waiter = asyncio.create_task(stream.finished.wait())
            await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in (*tasks, waiter):
                t.cancel()
            for t in tasks:
                exc = (await asyncio.gather(t, return_exceptions=True))[0]
                if isinstance(exc, Exception) and not stream.finished.is_set():
                    stream.log.error = type(exc).__name__
    except (TimeoutError, OSError, ConnectionClosed, InvalidHandshake) as exc:  # this case only
        log = stream.log if stream else CaseLog(case.cls, case.name)
        log.error = type(exc).__name__
        return log
    return stream.log


async def run_cases(url: str, cases: list[Case], concurrency: int) -> list[CaseLog]:
    """Every case, ``concurrency`` at a time (the first ones :data:`STAGGER_S` apart), in order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(k: int, case: Case) -> CaseLog:
        if k < concurrency:
            await asyncio.sleep(k * STAGGER_S)
        async with sem:
            return await run_case(url, case)

    return list(await asyncio.gather(*(one(k, c) for k, c in enumerate(cases))))


def write_trace(path: str, row: str, logs: list[CaseLog]) -> None:
    """Append a JSON line per case to ``path``: the row, class, name, and every event and each
    reply's first and latest audio arrival, in s from the true end of speech."""
    with open(path, "a", encoding="utf-8") as fh:
        for log in logs:
            t0 = log.true_end or 0.0
            fh.write(json.dumps({"row": row, "cls": log.cls, "name": log.name, "error": log.error,
                                 "burst_start": None if log.burst_start is None else round(log.burst_start - t0, 3),
                                 "events": [[round(t - t0, 3), e] for t, e in log.events
                                            if e.get("type") != "response.text.delta"],
                                 "audio": {rid: [round(t - t0, 3) for t in ts] for rid, ts in log.audio.items()}})
                     + "\n")


def _failure(log: Path) -> str:
    """The server's last log line that says something (its error), for a failed row."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errs or lines or ["server exited without a message"])[-1][:300]


def run_row(args: argparse.Namespace, name: str, cases: list[Case]) -> dict[str, Any]:
    """Start the row's server, play ``cases``, stop it. Returns ``{"row", "flags", "classes":
    {class: summary}, "cases": [CaseResult]}``, or ``{"row", "flags", "failed": message}``."""
    flags = [*BASE_FLAGS, *ROWS[name].split(), *args.serve_args.split()]
    port = free_port()
    log = Path(args.server_log_dir or tempfile.mkdtemp(prefix="turns-")) / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        proc = start_server(args.llm, port, flags, log=str(log))
    except RuntimeError as exc:
        return {"row": name, "flags": " ".join(flags), "failed": f"{exc}: {_failure(log)}"}
    url = f"ws://127.0.0.1:{port}/ws"
    try:
        asyncio.run(run_case(url, next(c for c in cases if c.burst is None) if any(c.burst is None for c in cases)
                             else cases[0]))  # warm-up, not counted: the first turn after a start is slow
        logs = asyncio.run(run_cases(url, cases, args.concurrency))
    finally:
        stop_server(proc)
    if args.trace:
        write_trace(args.trace, name, logs)
    results = [case_result(log) for log in logs]
    classes = [c for c in CLASSES if any(r.cls == c for r in results)]
    return {"row": name, "flags": " ".join(flags), "cases": results,
            "classes": {c: summarize([r for r in results if r.cls == c]) for c in classes}}


def _pair(x: tuple[float, float]) -> str:
    return "–" if math.isnan(x[0]) else f"{x[0]:.0f} / {x[1]:.0f}"


def _rate(x: float) -> str:
    return "–" if math.isnan(x) else f"{100 * x:.0f} %"


def format_table(table: list[dict[str, Any]]) -> str:
    """The Markdown table: a line per row and class (ms; rates in %; – where it does not apply)."""
    head = ("| row | class | cases | answered | premature EoT | ended in pause | EoT delay p50 / p95 | "
            "v2v p50 / p95 | burst over reply | reply lost | stop p50 / p95 | stopped ≤ 500 ms |")
    lines = [head, "|" + "---|" * 12]
    for row in table:
        if "failed" in row:
            lines.append(f"| {row['row']} | failed: {row['failed']} |" + " |" * 10)
            continue
        for cls, s in row["classes"].items():
            burst = cls in ("backchannel", "interruption", "noise")
            answered = str(s["answered"]) + "".join(f" ({s[k]} {k})" for k in ("busy", "errors") if s[k])
            cells = [row["row"], cls, str(s["cases"]), answered, _rate(s["premature"]),
                     _rate(s["ended_in_pause"]) if cls == "pause" else "–", _pair(s["eot_delay"]),
                     _pair(s["voice_to_voice"]), str(s["eligible"]) if burst else "–",
                     _rate(s["lost"]) if burst else "–",
                     _pair(s["stop_latency"]) if cls == "interruption" else "–",
                     _rate(s["stop_within_500"]) if cls == "interruption" else "–"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


LEGEND = ("premature EoT: reply audio before the user's true end of speech; ended in pause: a speech.stopped "
          "inside the thinking pause; EoT delay: speech.stopped of the last speech − true end; v2v: first reply "
          "audio − true end; burst over reply: cases whose burst began while the reply could still be stopped; "
          "reply lost: of those, replies cancelled (or paused and not resumed) — for interruptions the wanted "
          "outcome; stop: interruption's first word → response.paused or .cancelled. Backchannels are Piper TTS "
          "(the clips hold none); cough, door and keyboard are synthetic noise.")


def main(args: argparse.Namespace) -> int:
    """Print the table (or one JSON object with ``--json``); 1 if a row failed."""
    from dataclasses import asdict

    classes = tuple(args.classes or CLASSES)
    cases = build_set(args.per_class, seed=args.seed, classes=classes, audio_dir=Path(args.audio_dir))
    table = [run_row(args, name, cases) for name in args.rows]
    if args.json:
        out = {"llm": args.llm, "per_class": args.per_class, "concurrency": args.concurrency, "seed": args.seed,
               "rows": [{k: ([asdict(r) for r in v] if k == "cases" else v) for k, v in row.items()} for row in table]}
        print(json.dumps(jsonable(out), indent=1))
    else:
        print(f"LLM={args.llm}, {args.per_class} case(s) per class, {args.concurrency} at a time; "
              "cells: p50 / p95 ms")
        print(format_table(table))
        print()
        print(LEGEND)
    return 1 if any("failed" in row for row in table) else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``voxpipe bench turns``' options."""
    p.add_argument("--llm", default="smollm2")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                   help="server configurations to run (default: all): " +
                        "; ".join(f"{k}: {v}" for k, v in ROWS.items()))
    p.add_argument("--classes", nargs="+", default=None, choices=list(CLASSES), help="classes to play (default: all)")
    p.add_argument("--per-class", type=int, default=20, metavar="N", help="cases per class (20)")
    p.add_argument("--concurrency", type=int, default=3, metavar="N", help="cases played at once (3)")
    p.add_argument("--seed", type=int, default=0, help="seeds burst delays and synthetic noise (0)")
    p.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options for every row")
    p.add_argument("--server-log-dir", default=None, metavar="DIR",
                   help="write each row's server log to DIR/ROW.log (default: a temporary folder)")
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="append every case's wire events to FILE (JSON lines; times in s from the true end of speech)")
    p.add_argument("--json", action="store_true")
