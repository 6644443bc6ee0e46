"""Edge benchmark: does one abusive client slow another session down?

The issue's requirement: one client at 20× real time, or one sending maximal frames,
moves another session's voice-to-voice p50 by at most 10 %. For each scenario this
starts a FRESH ``voxpipe serve`` (SmolLM2 by default; ``--serve-args`` passes options
through) on a free port — a flood may leave a server degraded (SLO adaptation, a lowered
admission limit, an open breaker) for a minute, which would leak into the next scenario —
and runs a *victim* session on it: one connection, ``--warmup`` uncounted turns (the
server's first real turn), then ``--turns`` spoken turns, alternately
``en_cmu_goforward.wav`` and ``en_librispeech_3752-4944-0000.wav``, each sent in real time
(paced 20 ms PCM16 frames at the clip's 16 kHz) and followed by silence, still paced, as an
open microphone sends, until the reply's ``response.done``: VAD endpointing ends the turn,
no ``input.end``. A ``session.start`` before each turn restarts the audio position (the
conversation goes on), as ``voxpipe bench voice --turns`` does. Voice-to-voice is
``voxpipe ask``'s: the end of the user's speech (when its last speech sample was sent) →
the first reply audio frame received, as :class:`clients.turn.Turn` times it.

Scenarios (``--scenarios``, all by default), the *abuser* being a second session that
runs from ``--lead-in-s`` before the victim's first counted turn to its last:

- ``alone``: the victim only — the baseline.
- ``neighbour_1x``: a legitimate second user, streaming the abuser stream in real time.
- ``flood_20x``: the abuser stream at ``--speed`` (20) × real time, continuously.
- ``big_frames``: ``session.start`` PCM16 at 8 kHz, then binary frames of just under the
  server's 4 MiB message limit (≈ 262 s of audio each: the abuser stream, looped) back to
  back.

The abuser stream is four short English clips looped, each followed by 3 s of silence (over
the server's 2 s merge window, so every clip is a turn that gets a reply); the abuser
reads its socket all the time (a client that stops reading is closed as a slow client)
and ignores the replies, counting ``error`` events by code (e.g. ``rate_limited``) and
``busy`` by reason. When the server ends its session (e.g. its keepalive ping goes
unanswered behind megabytes of queued audio), it opens a new one half a second later, as
a determined abuser would; the table counts those closes. It runs in its own process: its
sends may block (a server that throttles a client stops reading its socket), and neither
a blocked send nor its CPU may stall the victim's event loop and so its timestamps. (Both
clients still share the machine's cores with the server.)

Printed per scenario: victim turns answered, victim voice-to-voice p50 and p95 (ms), the
p50's ratio to ``alone``'s, the abuser's audio sent (s, and its pace × real time), the audio
the server has processed (a lower bound: the latest ``audio_ms`` of its ``speech.started``
/ ``speech.stopped`` events), the abuser's replies, and its errors and refusals.
A victim turn with no reply event within ``--turn-timeout`` (30 s) is a ``timeout``; no
new turn starts after ``--scenario-timeout`` (120 s): the rest are ``not taken``.
``--json``: one JSON object instead.

Run: ``voxpipe bench edge`` (about 5 minutes on 2 cores). A measurement, not a test: run
it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import TurnRow, jsonable, turn_row
from bench.edge_abuser import (
    BIG_FRAME_BYTES,
    BIG_RATE,
    OUTPUT_RATE,
    AbuserProcess,
    AbuserStats,
)
from bench.load import pct
from bench.server import free_port, start_server, stop_server

if TYPE_CHECKING:
    from clients.turn import AskResult

SCENARIOS = ("alone", "neighbour_1x", "flood_20x", "big_frames")
ABUSER_KIND = {"alone": None, "neighbour_1x": "stream", "flood_20x": "stream", "big_frames": "big"}
"""What the second session does in each scenario (None: there is none)."""
VICTIM_CLIPS = ("en_cmu_goforward.wav", "en_librispeech_3752-4944-0000.wav")
ABUSER_CLIPS = ("en_cmu_goforward.wav", "en_librispeech_3752-4944-0000.wav", "en_librispeech_3752-4944-0002.wav",
                "en_librispeech_1988-24833-0003.wav")
BUSY_WAIT_MAX_S = 2.0
"""After a refused turn the victim waits the server's hint, at most this long."""
LIMIT_RATIO = 1.10
"""The issue's bound: another session's p50 moves by at most 10 %."""


# ---- what a scenario produced, and the table -------------------------------------------


@dataclass(slots=True)
class ScenarioResult:
    """One scenario: the victim's counted turns and the abuser's stats."""

    name: str
    turns: list[TurnRow]
    turns_asked: int
    abuser: AbuserStats | None = None
    seconds: float = 0.0  # the victim's counted turns, wall clock (s)
    server_died: bool = False  # the server process exited before the scenario ended


def _p50(xs: list[float]) -> float:
    """Median; nan when empty."""
    return statistics.median(xs) if xs else float("nan")


def _v2v(res: ScenarioResult) -> list[float]:
    return [t.voice_to_voice for t in res.turns if t.outcome == "answered" and t.voice_to_voice is not None]


def within_limit(ratio: float, answered: int, turns: int) -> bool | None:
    """The issue's bound for one scenario: every victim turn answered with audio and the
    p50 at most ``LIMIT_RATIO`` × ``alone``'s. None: no lost turn but no ratio to judge."""
    if answered < turns:
        return False
    return None if math.isnan(ratio) else ratio <= LIMIT_RATIO


def summarize(results: list[ScenarioResult]) -> list[dict[str, Any]]:
    """One row per scenario: victim turns answered with audio / asked (and by outcome:
    ``busy``, ``empty``, ``no audio`` (a reply without audio), ``timeout``, ``not taken``,
    or the exception that closed the victim's connection), voice-to-voice
    p50 / p95 (ms), the p50 over ``alone``'s p50 (nan without an ``alone`` row) and whether
    it is within the issue's bound (:func:`within_limit`), and the abuser's numbers (None
    without an abuser)."""
    base = next((_p50(_v2v(r)) for r in results if r.name == "alone"), float("nan"))
    rows = []
    for r in results:
        v2v = _v2v(r)
        outcomes: dict[str, int] = {}
        for t in r.turns:
            key = t.outcome if t.outcome != "error" else (t.error or "error").split()[0]
            if key == "answered" and t.voice_to_voice is None:  # a reply without audio (text only)
                key = "no audio"
            outcomes[key] = outcomes.get(key, 0) + 1
        if len(r.turns) < r.turns_asked:  # the scenario's time ran out, or the connection closed
            outcomes["not taken"] = r.turns_asked - len(r.turns)
        p50 = _p50(v2v)
        ratio = p50 / base if base and not math.isnan(base) and not math.isnan(p50) else float("nan")
        row: dict[str, Any] = {
            "scenario": r.name, "answered": outcomes.get("answered", 0), "turns": r.turns_asked,
            "outcomes": outcomes, "v2v_p50_ms": p50, "v2v_p95_ms": pct(v2v, 0.95), "p50_ratio": ratio,
            "within_limit": within_limit(ratio, outcomes.get("answered", 0), r.turns_asked),
            "server_v2v_p50_ms": _p50([t.server_voice_to_voice for t in r.turns
                                       if t.outcome == "answered" and t.server_voice_to_voice is not None]),
            "seconds": round(r.seconds, 1), "server_died": r.server_died, "abuser": None}
        if r.abuser is not None:
            a = r.abuser
            row["abuser"] = {"kind": a.kind, "seconds": round(a.seconds, 1), "messages": a.messages,
                             "audio_sent_s": round(a.audio_sent_s, 1), "pace": a.pace,
                             "audio_heard_s": round(a.audio_heard_s, 1), "max_send_ms": round(a.max_send_ms, 1),
                             "replies": a.replies, "connections": a.connections, "errors": dict(a.errors),
                             "busy": dict(a.busy), "closes": dict(a.closes), "failure": a.failure}
        rows.append(row)
    return rows


def _num(x: float, fmt: str = ".0f") -> str:
    return "–" if x is None or math.isnan(x) else format(x, fmt)


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "–"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of :func:`summarize`'s rows."""
    lines = ["| scenario | victim answered | v2v p50 ms | v2v p95 ms | p50 / alone | abuser audio sent s (pace) "
             "| server heard ≥ s | abuser replies | abuser errors | abuser busy |",
             "|" + "---|" * 10]
    for row in rows:
        answered = f"{row['answered']}/{row['turns']}"
        others = {k: v for k, v in row["outcomes"].items() if k != "answered"}
        if others:
            answered += f" ({_counts(others)})"
        if row["server_died"]:
            answered += " server died"
        ratio = _num(row["p50_ratio"], ".2f")
        if row["p50_ratio"] is not None and row["p50_ratio"] > LIMIT_RATIO:  # nan compares False
            ratio += f" (> {LIMIT_RATIO:.2f})"
        if row["answered"] < row["turns"]:
            ratio += " (turns lost)"
        a = row["abuser"]
        if a is None:
            tail = ["–"] * 5
        elif a["failure"]:
            tail = [f"failed: {a['failure']}", "–", "–", "–", "–"]
        else:
            closes = ", ".join(f"{k} ×{v}" for k, v in sorted(a["closes"].items()))
            errors = _counts(a["errors"]) + (f"; closed: {closes} (reconnected)" if closes else "")
            tail = [f"{a['audio_sent_s']:.0f} ({_num(a['pace'], '.1f')}×)", f"{a['audio_heard_s']:.0f}",
                    str(a["replies"]), errors, _counts(a["busy"])]
        lines.append("| " + " | ".join([row["scenario"], answered, _num(row["v2v_p50_ms"]), _num(row["v2v_p95_ms"]),
                                        ratio, *tail]) + " |")
    return "\n".join(lines)


# ---- the victim ---------------------------------------------------------------------


async def victim_turn(ws: Any, clip: Path, timeout_s: float) -> tuple[AskResult, bool]:
    """One spoken turn on an open session: ``session.start`` (keeps the conversation,
    restarts the audio position), the clip in real time and silence after it, still paced,
    until the reply is done (or ``busy``/``turn.empty``): an open microphone, no
    ``input.end``. Returns its ``AskResult`` (timings set) and whether it timed out (no
    reply event within ``timeout_s``)."""
    from clients.turn import Turn, pcm16_frames

    frames, rate, channels = pcm16_frames(str(clip))
    await ws.send(json.dumps({"type": "session.start", "sample_rate": rate, "format": "pcm16",
                              "channels": channels, "output_sample_rate": OUTPUT_RATE}))
    turn = Turn(ws, output_rate=OUTPUT_RATE)
    try:
        return await turn.run(frames, timeout_s=timeout_s, then_silence=True), False
    except TimeoutError:
        return turn.finish(), True


async def victim_turns(ws: Any, clips: list[Path], turns: int, timeout_s: float, deadline: float,
                        first: int = 0) -> list[TurnRow]:
    """``turns`` turns (clips alternating), until ``deadline`` (perf_counter s); a closed
    connection ends them with an ``error`` row."""
    from websockets.exceptions import ConnectionClosed

    rows: list[TurnRow] = []
    t0 = time.perf_counter()
    for k in range(turns):
        if time.perf_counter() > deadline:
            break
        clip = clips[(first + k) % len(clips)]
        start = time.perf_counter() - t0
        try:
            res, timed_out = await victim_turn(ws, clip, timeout_s)
        except (OSError, ConnectionClosed) as exc:
            rows.append(TurnRow(0, k + 1, round(start, 3), "error", clip.name, error=type(exc).__name__))
            break
        if timed_out:
            last = [e.get("type") for e in res.events if e.get("type") != "transcript.partial"][-1:] or ["none"]
            rows.append(TurnRow(0, k + 1, round(start, 3), "error", clip.name,
                                error=f"timeout (last event: {last[0]})"))
            continue
        rows.append(turn_row(res, 0, k + 1, start, clip.name))
        if res.busy is not None:
            await asyncio.sleep(min(BUSY_WAIT_MAX_S, (res.busy.get("retry_after_ms") or 0) / 1000))
    return rows


async def run_scenario_on(url: str, name: str, args: argparse.Namespace, victim: list[Path],
                          abuser: list[Path]) -> ScenarioResult:
    """Run scenario ``name`` against a ready server at ``url``."""
    from websockets.asyncio.client import connect

    kind = ABUSER_KIND[name]
    speed = args.speed if name == "flood_20x" else 1.0
    async with connect(url, max_size=None, open_timeout=10, close_timeout=2) as ws:
        for w in range(args.warmup):
            await victim_turn(ws, victim[w % len(victim)], args.turn_timeout)
        proc = AbuserProcess(url, kind, speed, abuser) if kind else None
        stats: AbuserStats | None = None
        try:
            if proc is not None and await proc.ready() is None:
                await asyncio.sleep(args.lead_in_s)
            t0 = time.perf_counter()
            rows = await victim_turns(ws, victim, args.turns, args.turn_timeout, t0 + args.scenario_timeout,
                                       first=args.warmup)
            seconds = time.perf_counter() - t0
        finally:
            if proc is not None:
                stats = await proc.finish()
    return ScenarioResult(name, rows, args.turns, stats, seconds)


def _scenario_log(log: str | None, name: str) -> str | None:
    """The server log for one scenario: ``x.log`` → ``x.<scenario>.log``."""
    if not log:
        return None
    p = Path(log)
    return str(p.with_name(f"{p.stem}.{name}{p.suffix}"))


def run_scenario(args: argparse.Namespace, name: str, victim: list[Path], abuser: list[Path]) -> ScenarioResult:
    """Start a fresh server, run scenario ``name`` on it, stop it."""
    port = free_port()
    proc = start_server(args.llm, port, args.serve_args.split(), log=_scenario_log(args.server_log, name))
    try:
        res = asyncio.run(run_scenario_on(f"ws://127.0.0.1:{port}/ws", name, args, victim, abuser))
        res.server_died = proc.poll() is not None
    finally:
        stop_server(proc)
    return res


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default="smollm2")
    p.add_argument("--turns", type=int, default=8, help="victim turns counted per scenario (8)")
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS),
                   help="which scenarios, in this order (default: all)")
    p.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options, e.g. '--slo-ms 3000'")
    p.add_argument("--server-log", default=None,
                   help="write each server's INFO log: PATH.log → PATH.<scenario>.log")
    p.add_argument("--speed", type=float, default=20.0, help="flood_20x's pace (× real time)")
    p.add_argument("--warmup", type=int, default=1, help="uncounted victim turns before the abuser starts (1)")
    p.add_argument("--lead-in-s", type=float, default=3.0,
                   help="the abuser runs this long before the victim's first counted turn")
    p.add_argument("--turn-timeout", type=float, default=30.0, help="a victim turn with no reply by then: error")
    p.add_argument("--scenario-timeout", type=float, default=120.0,
                   help="no new victim turn after this many seconds of a scenario")
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(args: argparse.Namespace) -> int:
    """``voxpipe bench edge``: run the scenarios, print the table (or JSON)."""
    audio = Path(args.audio_dir)
    victim, abuser = [audio / c for c in VICTIM_CLIPS], [audio / c for c in ABUSER_CLIPS]
    t0 = time.perf_counter()
    results = []
    for name in args.scenarios:
        results.append(run_scenario(args, name, victim, abuser))
        if not args.json:
            print(f"{name}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    runtime = time.perf_counter() - t0
    rows = summarize(results)
    if args.json:
        print(json.dumps(jsonable({"llm": args.llm, "turns": args.turns, "serve_args": args.serve_args,
                                    "speed": args.speed, "runtime_s": round(runtime, 1), "scenarios": rows,
                                    "victim_turns": {r.name: [asdict(t) for t in r.turns] for r in results}}),
                         indent=1))
        return 0
    print(f"\nLLM={args.llm}, a fresh server per scenario; victim: {args.turns} turns ({', '.join(VICTIM_CLIPS)} "
          f"alternately, real time), voice-to-voice = end of speech → first reply audio at the client; "
          f"flood at {args.speed:g}× real time; big frames: {BIG_FRAME_BYTES} B of PCM16 at {BIG_RATE} Hz; "
          f"limit: every turn answered, p50 / alone ≤ {LIMIT_RATIO:.2f}")
    print(format_table(rows))
    print(f"runtime {runtime:.0f} s")
    return 0
