"""``voxpipe bench memory``: does the server grow conversation after conversation (issue 37)?

Starts ``voxpipe serve --llm LLM`` and runs N back-to-back conversations through it (with
``--talkers T``: N rounds of T conversations at once, a reading after each round): each is
one session that plays ``--turns-per-conversation`` English clips of the test audio folder
at real-time pace, waits for each reply (``response.done``, ``busy`` or ``turn.empty``),
then closes. After each one, once the server is idle again (no session open, nothing in
the LLM's batch) and ``--settle-s`` more (the LLM engine trims the heap when it goes idle),
it scrapes ``/metrics``: the RSS and each part of ``voxpipe_memory_bytes``
(pipeline/memory_parts.py). Conversation *k* starts from clip *k* × turns (rotated), so the
conversations do not all say the same.

Prints a markdown table (MB = MiB): conversation (0: after start-up and warm-up, before
any), RSS, each part seen non-zero, the anonymous part of the RSS and the thread count
(``/proc/PID/status``: memory no file backs, and threads, each with its own stack and
maybe malloc arena), the RSS by kind of mapping (:func:`smaps_split`: glibc's main heap,
its thread arenas, other anonymous mappings, files), and a last row with each column's slope in MB per
conversation over the last half of the conversations (least squares): a leak keeps a
positive slope once caches and arenas have reached their size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import TurnRow, english_clips
from bench.server import free_port, start_server, stop_server
from bench.voice import metric_sum, run_conversation, scrape_metrics

MIB = 1 << 20
PART_METRIC = "voxpipe_memory_bytes"
RSS_METRIC = "voxpipe_process_rss_bytes"
IDLE_WAIT_S = 120.0
"""How long to wait for the server to be idle after a conversation (s) before reading anyway."""


@dataclass(slots=True)
class Reading:
    """One ``/metrics`` reading after ``conversation`` conversations: the RSS and every
    memory part (bytes), and how the conversation's turns went."""

    conversation: int
    rss: float
    parts: dict[str, float]
    outcomes: dict[str, int] = field(default_factory=dict)
    anon: float = 0.0  # RssAnon of /proc/PID/status (bytes; 0: not read)
    threads: int = 0  # the server's threads (0: not read)
    maps: dict[str, float] = field(default_factory=dict)  # resident bytes by kind of mapping (smaps_split)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default="smollm2", help="the server's --llm (smollm2)")
    p.add_argument("--conversations", type=int, default=10, help="back-to-back conversations (10)")
    p.add_argument("--turns-per-conversation", type=int, default=3, help="clips spoken per conversation (3)")
    p.add_argument("--talkers", type=int, default=1,
                   help="conversations at once in each round (1: back to back); a reading after each round")
    p.add_argument("--settle-s", type=float, default=2.0,
                   help="wait this long after the server is idle before each reading (2)")
    p.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options")
    p.add_argument("--turn-timeout", type=float, default=120.0)
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--log", default=None, help="write the server's INFO log here")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def parts_of(body: str | None) -> dict[str, float]:
    """``voxpipe_memory_bytes`` by part on a ``/metrics`` page (empty when it has none)."""
    found = re.findall(rf'^{PART_METRIC}\{{part="([^"]+)"\}} (\S+)$', body or "", re.M)
    return {part: float(v) for part, v in found}


def slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against 0, 1, 2, ... (per step; 0 for fewer than 2)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


def last_half(readings: list[Reading]) -> list[Reading]:
    """The readings after the last half of the conversations (at least two, when there are)."""
    runs = [r for r in readings if r.conversation > 0]
    return runs[len(runs) // 2 :] if len(runs) >= 4 else runs[-2:]


def format_table(readings: list[Reading]) -> str:
    """The markdown table: a row per reading, then the slopes over :func:`last_half`."""
    names = [p for p in _order(readings) if any(r.parts.get(p) for r in readings)]
    maps = [k for k in ("heap", "arenas", "mmap", "file") if any(r.maps.get(k) for r in readings)]
    head = ["conversation", "RSS MB", *(f"{p} MB" for p in names), "anon MB", *(f"{k} MB" for k in maps), "threads",
            "turns"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in readings:
        turns = ", ".join(f"{n} {k}" for k, n in sorted(r.outcomes.items())) or "-"
        cells = [str(r.conversation), _mb(r.rss), *(_mb(r.parts.get(p, 0.0)) for p in names), _mb(r.anon),
                 *(_mb(r.maps.get(k, 0.0)) for k in maps), str(r.threads), turns]
        lines.append("| " + " | ".join(cells) + " |")
    half = last_half(readings)
    if len(half) >= 2:
        span = f"{half[0].conversation}-{half[-1].conversation}"
        slopes = [slope([r.rss for r in half]), *(slope([r.parts.get(p, 0.0) for r in half]) for p in names),
                  slope([r.anon for r in half]), *(slope([r.maps.get(k, 0.0) for r in half]) for k in maps)]
        lines.append(f"| slope MB/conv ({span}) | " + " | ".join(f"{s / MIB:+.2f}" for s in slopes)
                     + f" | {slope([float(r.threads) for r in half]):+.2f} | |")
    return "\n".join(lines)


def _order(readings: list[Reading]) -> list[str]:
    from pipeline.memory_parts import PARTS

    seen = {p for r in readings for p in r.parts}
    return [p for p in PARTS if p in seen] + sorted(seen - set(PARTS))


def _mb(x: float) -> str:
    return f"{x / MIB:.1f}"


def proc_status(pid: int | None) -> tuple[float, int]:
    """(anonymous resident bytes, threads) of process ``pid`` from ``/proc/PID/status``;
    (0, 0) where it cannot be read (not Linux, no such process, None)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            fields = dict(line.split(":", 1) for line in fh if ":" in line)
        return float(fields["RssAnon"].split()[0]) * 1024, int(fields["Threads"])
    except (OSError, KeyError, ValueError):
        return 0.0, 0


ARENA_ALIGN = 64 << 20
"""glibc's non-main malloc arenas live in anonymous mappings of HEAP_MAX_SIZE (64 MiB on 64-bit)
aligned to their size (malloc/arena.c ``new_heap``): how :func:`smaps_split` tells them apart."""


def smaps_split(pid: int | None) -> dict[str, float]:
    """Resident bytes of process ``pid`` by kind of mapping, from ``/proc/PID/smaps``:
    ``heap`` (the brk heap: glibc's main arena), ``arenas`` (anonymous mappings starting on a
    64 MiB boundary: glibc's per-thread arenas), ``mmap`` (other anonymous mappings: large
    allocations such as torch tensors and onnxruntime's arena, thread stacks), ``file``
    (files: libraries, mapped models). Empty where it cannot be read."""
    out = dict.fromkeys(("heap", "arenas", "mmap", "file"), 0.0)
    kind = "file"
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    start = int(head[0].split("-")[0], 16)
                    name = head[5].strip() if len(head) > 5 else ""
                    kind = ("heap" if name == "[heap]" else "file" if name and not name.startswith("[")
                            else "arenas" if not name and start % ARENA_ALIGN == 0 else "mmap")
                elif head and head[0] == "Rss:":
                    out[kind] += float(head[1]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def _idle(body: str | None) -> bool:
    return metric_sum(body, "voxpipe_sessions") == 0 and not metric_sum(body, "voxpipe_llm_running")


def read(http: str, conversation: int, settle_s: float, outcomes: dict[str, int], pid: int | None = None) -> Reading:
    """Wait for the server to be idle (at most :data:`IDLE_WAIT_S`), ``settle_s`` more, then
    read its RSS and memory parts (and process ``pid``'s anonymous memory and threads).

    Raises:
        RuntimeError: ``/metrics`` did not answer, or has no RSS.
    """
    deadline = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < deadline and not _idle(scrape_metrics(http)):
        time.sleep(0.2)
    time.sleep(settle_s)
    body = scrape_metrics(http)
    rss = metric_sum(body, RSS_METRIC)
    if rss is None:
        raise RuntimeError(f"no {RSS_METRIC} on {http}/metrics")
    return Reading(conversation, rss, parts_of(body), outcomes, *proc_status(pid), smaps_split(pid))


def run(args: argparse.Namespace, clips: list[Path], port: int, pid: int | None = None) -> list[Reading]:
    """The conversations against a server on ``port`` (process ``pid``); a reading before
    and after each."""
    http, url = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/ws"
    readings = [read(http, 0, args.settle_s, {}, pid)]
    turns = args.turns_per_conversation
    for k in range(1, args.conversations + 1):
        rows: list[TurnRow] = []
        asyncio.run(_round(url, clips, k, args.talkers, turns, args.turn_timeout, rows))
        outcomes: dict[str, int] = {}
        for row in rows:
            outcomes[row.outcome] = outcomes.get(row.outcome, 0) + 1
        readings.append(read(http, k, args.settle_s, outcomes, pid))
        if not args.json:
            r = readings[-1]
            print(f"conversation {k}: RSS {_mb(r.rss)} MB, rest {_mb(r.parts.get('rest', 0.0))} MB", flush=True)
    return readings


async def _round(url: str, clips: list[Path], k: int, talkers: int, turns: int, timeout_s: float,
                 rows: list[TurnRow]) -> None:
    """Round ``k``: ``talkers`` conversations at once, each from its own clip (rotated)."""
    t0 = time.perf_counter()
    runs = []
    for j in range(talkers):
        start = ((k - 1) * talkers + j) * turns % len(clips)
        runs.append(run_conversation(url, clips[start:] + clips[:start], (k - 1) * talkers + j + 1, rows, t0=t0,
                                     turns=turns, deadline=None, timeout_s=timeout_s))
    await asyncio.gather(*runs)


def main(args: argparse.Namespace) -> int:
    """``voxpipe bench memory``: start the server, run the conversations, print the table."""
    if min(args.conversations, args.turns_per_conversation, args.talkers) < 1:
        print("--conversations, --turns-per-conversation and --talkers must be >= 1")
        return 2
    clips = english_clips(Path(args.audio_dir))
    port = free_port()
    proc = start_server(args.llm, port, args.serve_args.split(), log=args.log)
    try:
        readings = run(args, clips, port, proc.pid)
    finally:
        stop_server(proc)
    if args.json:
        half = last_half(readings)
        print(json.dumps({"llm": args.llm, "turns_per_conversation": args.turns_per_conversation,
                          "talkers": args.talkers,
                          "readings": [asdict(r) for r in readings],
                          "rss_slope_mib_per_conversation": slope([r.rss for r in half]) / MIB}, indent=1))
        return 0
    rounds = f"{args.conversations} rounds of {args.talkers} conversations at once" if args.talkers > 1 else \
        f"{args.conversations} conversations"
    print(f"\nvoxpipe bench memory: --llm {args.llm}, {rounds}, {args.turns_per_conversation} turns each "
          f"(MB = MiB; read once idle + {args.settle_s:g} s)\n")
    print(format_table(readings))
    return 0
