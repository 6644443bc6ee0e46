"""Load benchmark: does the server keep its latency SLO under a flood? (DESIGN.md §5)

Starts ``voxpipe serve`` (SmolLM2 by default, the default SLO), then offers spoken turns
— real English clips from tests/data/audio, each streamed in real time on its own
connection — with Poisson (or bursty) arrivals at a rate R (turns/s), for ``--duration``
seconds per rate. A sweep raises R until fewer than 99 % of turns meet the SLO or any is
refused: the last rate that held is the sustainable rate R_sus. Then it runs at 0.5×, 1×,
2× and 3× R_sus and prints per rate: goodput (turns answered within the SLO per second),
refusals by reason, voice-to-voice p50/p95/p99 at the client (end of speech → first reply
audio, the end-of-turn silence included), LLM TTFT and time to first audio p50/p95, how
long a refusal took (end of speech → ``busy``, p99), the server's peak RSS, and whether
the server's ``voxpipe_admissions_total`` counters equal the benchmark's own counts.

Run: ``voxpipe bench load`` (``--help`` for options). A measurement, not a test: run it
on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Turn:
    """One offered turn's outcome (ms at the client, from the end of speech)."""

    outcome: str  # "answered" | "busy:<reason>" | "empty" | "error"
    voice_to_voice: float | None = None
    llm_ttft: float | None = None
    first_audio: float | None = None
    busy_ms: float | None = None
    busy_after_stop_ms: float | None = None  # the server's speech.stopped → busy, at the client
    busy_events: list[str] = field(default_factory=list)  # reasons of every busy the clip got
    # (a clip with long pauses is several turns: each is admitted or refused on its own)


@dataclass(slots=True)
class RateRow:
    """What one offered rate produced."""

    rate: float
    offered: int = 0
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    end_rss_mb: float = 0.0
    counters_match: bool = True
    client_lag_ms: list[float] = field(default_factory=list)  # the bench's own event-loop lag samples
    server_lag_p99_ms: float = float("nan")  # the server's event-loop lag p99 (histogram bucket bound)
    heavy: dict[str, int] = field(default_factory=dict)  # the heavy session's outcomes, by event type

    def within(self, slo_ms: float) -> list[Turn]:
        return [t for t in self.turns if t.outcome == "answered" and t.voice_to_voice is not None
                and t.voice_to_voice <= slo_ms]

    def refused(self) -> dict[str, int]:
        """``busy`` events by reason, over every turn of every clip."""
        out: dict[str, int] = {}
        for t in self.turns:
            for reason in t.busy_events:
                out[reason] = out.get(reason, 0) + 1
        return out


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs`` (nearest rank); nan when empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def arrivals(rate: float, duration_s: float, *, bursty: bool, rng: random.Random) -> list[float]:
    """Arrival times (s from the start) of a Poisson process at ``rate``/s; ``bursty``:
    the same mean rate in bursts of 4 turns at once."""
    out: list[float] = []
    t, k = 0.0, 4 if bursty else 1
    while True:
        t += rng.expovariate(rate / k)
        if t >= duration_s:
            return out
        out += [t] * k


async def one_turn(url: str, clip: Path, timeout_s: float) -> Turn:
    from clients.client import ServerUnavailable, ask

    try:
        res = await ask(str(clip), url=url, timeout_s=timeout_s, output_rate=16000)
    except (TimeoutError, ServerUnavailable, OSError) as exc:
        return Turn(f"error:{type(exc).__name__}")
    t = res.timings_ms
    busy = [str(e.get("reason")) for e in res.events if e.get("type") == "busy"]
    if res.busy is not None and not res.reply_text:
        return Turn(f"busy:{res.busy.get('reason')}", busy_ms=t.get("busy"),
                    busy_after_stop_ms=t.get("busy_after_stop"), busy_events=busy)
    if res.reply_text:
        return Turn("answered", t.get("voice_to_voice"), t.get("llm_ttft"), t.get("first_audio"), busy_events=busy)
    return Turn("empty", busy_events=busy)


def scrape(http: str) -> str:
    with urllib.request.urlopen(http + "/metrics") as r:
        return r.read().decode()


def admissions(body: str) -> dict[tuple[str, str], float]:
    """``voxpipe_admissions_total`` by (decision, reason) from a /metrics page."""
    found = re.findall(r'^voxpipe_admissions_total\{decision="(\w+)",reason="(\w*)"\} (\S+)$', body, re.M)
    return {(d, reason): float(v) for d, reason, v in found}


def lag_buckets(body: str) -> dict[float, float]:
    """The server's event-loop lag histogram: cumulative counts by upper bound (s)."""
    found = re.findall(r'^voxpipe_event_loop_lag_seconds_bucket\{le="([^"]+)"\} (\S+)$', body, re.M)
    return {float(le): float(v) for le, v in found}


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound (ms) of the bucket holding the ``q`` quantile of what was added
    between two scrapes of a histogram (nan when nothing was)."""
    delta = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = delta[-1][1] if delta else 0.0
    for le, n in delta:
        if total and n >= q * total:
            return le * 1000
    return float("nan")


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


HEAVY_TEXT = ("Please summarise all of the following notes in detail before you answer. "
              + "The quarterly figures moved in several directions at once, and the team wrote it all down. " * 90
              )[:7900]
"""A heavy typed turn: 7,900 characters (the protocol takes up to 8,000; the server cuts it to
the LLM's prompt budget)."""


async def heavy_session(url: str, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """One session that sends :data:`HEAVY_TEXT` again as soon as each reply ends (or is
    refused), until ``stop``: the appetite that fairness must keep from the others."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000, "format": "pcm16", "channels": 1,
                                  "output_sample_rate": 16000}))
        while not stop.is_set():
            await ws.send(json.dumps({"type": "text.input", "text": HEAVY_TEXT}))
            while True:
                msg = await ws.recv()
                if isinstance(msg, bytes):
                    continue
                ev = json.loads(msg)
                kind = ev["type"]
                if kind in ("response.done", "response.cancelled", "busy", "error"):
                    key = f"busy:{ev.get('reason')}" if kind == "busy" else kind
                    counts[key] = counts.get(key, 0) + 1
                    if kind in ("busy", "error"):
                        await asyncio.sleep(0.2)
                    break


async def run_rate(url: str, http: str, pid: int, clips: list[Path], rate: float, args,
                   heavy: bool = False) -> RateRow:
    """Offer turns at ``rate`` for ``args.duration`` s; wait for every outcome. ``heavy``:
    one more session sends 8,000-character questions back to back meanwhile."""
    rng = random.Random(args.seed)
    row = RateRow(rate)
    page = await asyncio.to_thread(scrape, http)
    before, lag_before = admissions(page), lag_buckets(page)
    probe = asyncio.create_task(_probe_lag(row.client_lag_ms))  # is the load generator itself late?
    stop_heavy = asyncio.Event()
    heavy_task = asyncio.create_task(heavy_session(url, stop_heavy, row.heavy)) if heavy else None
    t0 = time.perf_counter()
    tasks = []
    for at in arrivals(rate, args.duration, bursty=args.bursty, rng=rng):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_turn(url, rng.choice(clips), args.turn_timeout)))
        row.peak_rss_mb = max(row.peak_rss_mb, rss_mb(pid))
    pending = set(tasks)
    while pending:
        _, pending = await asyncio.wait(pending, timeout=0.5)
        row.peak_rss_mb = max(row.peak_rss_mb, rss_mb(pid))
    row.turns = [t.result() for t in tasks]
    row.offered, row.seconds = len(tasks), time.perf_counter() - t0
    row.end_rss_mb = rss_mb(pid)
    probe.cancel()
    if heavy_task is not None:
        stop_heavy.set()
        await asyncio.wait({heavy_task}, timeout=120)
        heavy_task.cancel()
    page = await asyncio.to_thread(scrape, http)
    after = admissions(page)
    row.server_lag_p99_ms = bucket_quantile(lag_before, lag_buckets(page), 0.99)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    refused = row.refused()
    for key, n in row.heavy.items():  # the heavy session's refusals count on the server too
        if key.startswith("busy:"):
            refused[key[5:]] = refused.get(key[5:], 0) + n
    server_refused = {k[1]: v for k, v in delta.items() if k[0] == "refused" and v}
    answered_or_empty = sum(1 for t in row.turns if t.outcome in ("answered", "empty"))
    row.counters_match = (server_refused == {k: float(v) for k, v in refused.items()}
                          and delta.get(("admitted", ""), 0.0) >= answered_or_empty)
    return row


async def _probe_lag(out: list[float], interval_s: float = 0.05) -> None:
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(interval_s)
        out.append(max(0.0, (time.perf_counter() - t0 - interval_s) * 1000))


def format_row(row: RateRow, slo_ms: float, label: str) -> str:
    answered = [t for t in row.turns if t.outcome == "answered"]
    v2v = [t.voice_to_voice for t in answered if t.voice_to_voice is not None]
    ttft = [t.llm_ttft for t in answered if t.llm_ttft is not None]
    fa = [t.first_audio for t in answered if t.first_audio is not None]
    busy = [t.busy_ms for t in row.turns if t.busy_ms is not None]
    after_stop = [t.busy_after_stop_ms for t in row.turns if t.busy_after_stop_ms is not None]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(row.refused().items())) or "0"
    good = len(row.within(slo_ms)) / row.seconds if row.seconds else 0.0
    return (f"| {label} | {row.rate:.2f} | {row.offered} | {len(answered)} | {refused} | {good:.2f} | "
            f"{pct(v2v, .5):.0f} / {pct(v2v, .95):.0f} / {pct(v2v, .99):.0f} | "
            f"{pct(ttft, .5):.0f} / {pct(ttft, .95):.0f} | {pct(fa, .5):.0f} / {pct(fa, .95):.0f} | "
            f"{pct(busy, .99):.0f} / {pct(after_stop, .99):.0f} | {row.peak_rss_mb:.0f} / {row.end_rss_mb:.0f} | "
            f"≤{row.server_lag_p99_ms:.0f} / {pct(row.client_lag_ms, .99):.0f} | "
            f"{'yes' if row.counters_match else 'NO'} |")


def holds(row: RateRow, slo_ms: float) -> bool:
    """The rate is sustainable: ≥ 99 % of offered turns answered within the SLO, none refused."""
    return not row.refused() and len(row.within(slo_ms)) >= 0.99 * max(1, row.offered - _empty(row))


def _empty(row: RateRow) -> int:
    return sum(1 for t in row.turns if t.outcome == "empty")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default="smollm2")
    from pipeline.config import AdmissionConfig

    p.add_argument("--slo-ms", type=float, default=AdmissionConfig().slo_ms, help="the server's SLO (passed to serve)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    p.add_argument("--start-rate", type=float, default=0.1, help="first rate of the sweep (turns/s)")
    p.add_argument("--max-rate", type=float, default=4.0, help="the sweep stops here")
    p.add_argument("--rate", type=float, default=0.0, help="skip the sweep: use this as R_sus")
    p.add_argument("--multiples", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    p.add_argument("--bursty", action="store_true", help="arrivals in bursts of 4 at the same mean rate")
    p.add_argument("--turn-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options")
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--server-log", default=None, help="write the server's INFO log to this file")
    p.add_argument("--fairness", action="store_true",
                   help="at --rate × the first multiple: without, then with one heavy session (8,000-character "
                        "questions back to back); print both and the ratio of the others' v2v p95")
    p.add_argument("--llm-table-requests", type=int, default=24,
                   help="requests per mode for the design article's four-row table (voxpipe bench llm), run "
                        "after the load on the same machine; 0: skip it")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    from bench.voice import _clips, _free_port, _start_server, stop_server

    clips = _clips(Path(args.audio_dir))
    port = _free_port()
    proc = _start_server(args.llm, port, ["--slo-ms", str(args.slo_ms), *args.serve_args.split()],
                         log=args.server_log)
    url, http = f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}"
    sweep: list[RateRow] = []
    rows: list[tuple[str, RateRow]] = []
    try:
        r_sus = args.rate
        if not r_sus:
            rate = args.start_rate
            while rate <= args.max_rate:
                row = asyncio.run(run_rate(url, http, proc.pid, clips, rate, args))
                sweep.append(row)
                print(f"sweep: {rate:.2f} turns/s: {'holds' if holds(row, args.slo_ms) else 'does not hold'}",
                      flush=True)
                if not holds(row, args.slo_ms):
                    break
                r_sus = rate
                rate *= 1.5
        r_sus = r_sus or args.start_rate
        if args.fairness:
            rate = args.multiples[0] * r_sus
            rows.append(("others alone", asyncio.run(run_rate(url, http, proc.pid, clips, rate, args))))
            rows.append(("+ 1 heavy session", asyncio.run(run_rate(url, http, proc.pid, clips, rate, args,
                                                                  heavy=True))))
        else:
            for m in args.multiples:
                row = asyncio.run(run_rate(url, http, proc.pid, clips, m * r_sus, args))
                rows.append((f"{m:g}× R_sus", row))
    finally:
        stop_server(proc)
    labelled = [*((f"sweep {r.rate:.2f}", r) for r in sweep), *rows]
    if args.json:
        print(json.dumps({"r_sus": r_sus, "slo_ms": args.slo_ms,
                          "rows": [{"label": lbl, **asdict(r)} for lbl, r in labelled]}, indent=1))
        return 0
    kind = "bursty (4 at once)" if args.bursty else "Poisson"
    print(f"LLM={args.llm} SLO={args.slo_ms:.0f} ms, {kind} arrivals, {args.duration:.0f} s per rate, "
          f"R_sus={r_sus:.2f} turns/s; ms unless noted")
    print("| load | turns/s | offered | answered | refused | goodput/s | v2v p50/p95/p99 | TTFT p50/p95 | "
          "first audio p50/p95 | busy p99 (speech end / end-of-turn event) | RSS MB peak / end | "
          "loop lag p99 server / bench | counters = bench |")
    print("|" + "---|" * 13)
    for label, row in labelled:
        print(format_row(row, args.slo_ms, label))
    if args.fairness and len(rows) == 2:
        p95 = [pct([t.voice_to_voice for t in r.turns if t.outcome == "answered" and t.voice_to_voice], .95)
               for _, r in rows]
        print(f"the others' v2v p95 with / without the heavy session: {p95[1] / p95[0]:.2f} "
              f"(heavy session: {rows[1][1].heavy})")
    goodput = {lbl: len(r.within(args.slo_ms)) / r.seconds for lbl, r in rows if r.seconds}
    if "1× R_sus" in goodput and "3× R_sus" in goodput and goodput["1× R_sus"]:
        print(f"goodput at 3× / 1× R_sus: {goodput['3× R_sus'] / goodput['1× R_sus']:.2f}")
    if args.llm_table_requests > 0:
        print("\nThe design article's four-row table (no batching / static / dynamic / quantized), same machine:",
              flush=True)
        subprocess.run([sys.executable, "-m", "cli", "bench", "llm", "--llm", args.llm, "--requests",
                        str(args.llm_table_requests)], check=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
