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
"""

from __future__ import annotations

import asyncio
import csv
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(llm: str, port: int, extra: list[str], log: str | None = None) -> subprocess.Popen:
    """Start ``voxpipe serve`` and wait for /healthz; ``log``: a file for its INFO log
    (None: WARNING and up, discarded)."""
    sink = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--llm", llm, "--port", str(port),
                             "--log-level", "INFO" if log else "WARNING", *extra],
                            stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready")


def _clips(audio_dir: Path) -> list[Path]:
    with open(audio_dir / "manifest.tsv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    return [audio_dir / r["file"] for r in rows if r["language"] == "en" and "hard" not in r["file"]]


async def _session(url: str, clips: list[Path], out: list[dict]) -> None:
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
    xs = sorted(r[key] for r in rows if r.get(key) is not None)
    if not xs:
        return float("nan"), float("nan")
    return statistics.median(xs), xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def main(args) -> int:
    audio_dir = Path(args.audio_dir)
    clips = _clips(audio_dir)
    if args.jfk_only:
        clips = [c for c in clips if "jfk" in c.name]
    port = _free_port()
    proc = _start_server(args.llm, port, args.serve_args.split(), log=args.server_log)
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
            rows = answered
            for key in ("first_token_to_audio", "first_phrase_to_audio", "tts_rtf", "llm_ttft", "asr",
                        "voice_to_voice", "client_voice_to_voice"):
                row[key] = _stat(rows, key)
            table.append(row)
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    keys = ["first_token_to_audio", "first_phrase_to_audio", "tts_rtf", "llm_ttft", "asr", "voice_to_voice",
            "client_voice_to_voice"]
    print(f"LLM={args.llm}, clips={len(clips)} x{args.repeat} per session; each cell: p50 / p95 (ms; RTF unitless); "
          f"within SLO: answered turns with client voice-to-voice <= {args.slo_ms:.0f} ms")
    print("| sessions | responses | busy | within SLO | max v2v | " + " | ".join(keys) + " |")
    print("|" + "---|" * (len(keys) + 5))
    for row in table:
        cells = [f"{row[k][0]:.0f} / {row[k][1]:.0f}" if k != "tts_rtf" else f"{row[k][0]:.3f} / {row[k][1]:.3f}"
                 for k in keys]
        print(f"| {row['sessions']} | {row['responses']} | {row['busy']} | {100 * row['within_slo']:.0f} % | "
              f"{row['max_v2v']:.0f} | " + " | ".join(cells) + " |")
    return 0
