"""``voxpipe bench voice --variant NAME=SERVE_ARGS ...``: the same clips through one server run
per variant, one table with a row per variant (and sessions value), side by side.

A variant is a name and extra ``voxpipe serve`` options, appended after ``--llm`` and
``--serve-args`` (a later option wins, so a variant may also replace the LLM), e.g.::

    voxpipe bench voice --sessions 1 --variant piper= --variant coqui="--tts coqui:/tmp/vits"
    voxpipe bench voice --variant local= --variant remote="--llm openai:http://127.0.0.1:8000/v1#smollm2"

Columns: first audio (the server's response start → first audio sent, ``timings_ms.first_audio``),
TTS real-time factor (synthesis time ÷ audio time of each reply's first phrase, as the
server reports it in ``timings_ms.tts_rtf``), first phrase → audio, LLM TTFT and the client's
voice-to-voice; each p50 / p95 over the answered turns.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

from bench.common import jsonable
from bench.voice_table import single_turn_table

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")

COLUMNS = (("first_audio", "first audio"), ("tts_rtf", "TTS RTF"), ("first_phrase_to_audio", "first phrase → audio"),
           ("llm_ttft", "LLM TTFT"), ("client_voice_to_voice", "voice-to-voice (client)"))
"""(row key, heading) of the per-variant table's timing columns."""


def parse_variants(items: list[str]) -> list[tuple[str, list[str]]]:
    """``NAME=SERVE_ARGS`` strings → (name, options split as a shell would), in order.

    Raises:
        ValueError: no ``=``, an empty or odd name (letters, digits, ``_.+-``), a name given
            twice, or options a shell could not split (an unclosed quote).
    """
    out: list[tuple[str, list[str]]] = []
    for item in items:
        name, sep, rest = item.partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise ValueError(f"--variant {item!r}: expected NAME=SERVE_ARGS, e.g. piper= or coqui='--tts coqui:DIR'")
        if any(name == n for n, _ in out):
            raise ValueError(f"--variant {name!r} is given twice")
        try:
            out.append((name, shlex.split(rest)))
        except ValueError as exc:
            raise ValueError(f"--variant {item!r}: {exc}") from None
    return out


def variant_log(log: str | None, name: str) -> str | None:
    """The server log's path for one variant (``x.log`` → ``x.NAME.log``); None without ``--server-log``."""
    if not log:
        return None
    p = Path(log)
    return str(p.with_name(f"{p.stem}.{name}{p.suffix}"))


def format_table(rows: list[dict]) -> str:
    """A markdown table: one row per (variant, sessions); a failed variant says why."""
    head = ["variant", "sessions", "responses", "busy", *(h for _, h in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | - | - | - | failed: {r['error']} |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = [_cell(r[k], k) for k, _ in COLUMNS]
        lines.append(f"| {r['variant']} | {r['sessions']} | {r['responses']} | {r['busy']} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def _cell(v: tuple[float, float], key: str) -> str:
    fmt = ".3f" if key == "tts_rtf" else ".0f"
    return f"{v[0]:{fmt}} / {v[1]:{fmt}}"


def variants_main(args: argparse.Namespace, clips: list[Path]) -> int:
    """Run every ``--variant`` in turn (a server each, the same clips and sessions), print one
    table (or JSON with ``--json``). Returns 2 for a bad ``--variant``, 1 if a variant's server
    failed (its row says so; the others still run), else 0."""
    try:
        variants = parse_variants(args.variant)
    except ValueError as exc:
        print(f"voxpipe bench voice: {exc}", file=sys.stderr)
        return 2
    base = shlex.split(args.serve_args)
    rows: list[dict] = []
    for name, extra in variants:
        try:
            table = single_turn_table(args, clips, [*base, *extra], log=variant_log(args.server_log, name))
        except RuntimeError as exc:
            rows.append({"variant": name, "serve_args": extra, "error": str(exc)})
            continue
        rows += [{"variant": name, "serve_args": extra, **row} for row in table]
    if args.json:
        print(json.dumps(jsonable(rows), indent=1))
    else:
        print(f"LLM={args.llm} (unless a variant sets --llm), clips={len(clips)} x{args.repeat} per session, one "
              "server run per variant; each cell: p50 / p95 (ms; RTF unitless)")
        for name, extra in variants:
            print(f"  {name}: voxpipe serve {shlex.join([*base, *extra]) or '(defaults)'}")
        print(format_table(rows))
    return 1 if any("error" in r for r in rows) else 0
