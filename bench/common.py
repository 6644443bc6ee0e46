"""What the benchmarks share besides the server (:mod:`bench.server`): the test clips, a
turn's row, and JSON output."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.turn import AskResult


def english_rows(audio_dir: Path) -> list[dict[str, str]]:
    """The rows of ``audio_dir/manifest.tsv`` (``file``, ``language``,
    ``reference_transcript``, ...) of the English clips, less the "hard" ones."""
    with open(audio_dir / "manifest.tsv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    return [r for r in rows if r["language"] == "en" and "hard" not in r["file"]]


def english_clips(audio_dir: Path) -> list[Path]:
    """The paths of :func:`english_rows`' clips, in the manifest's order."""
    return [audio_dir / r["file"] for r in english_rows(audio_dir)]


@dataclass(slots=True)
class TurnRow:
    """One turn of a multi-turn session. Times in ms, except ``t_s``."""

    session: int  # 0-based session number
    turn: int  # 1-based turn index within the session
    t_s: float  # when the turn's clip began streaming, s since the run's start
    outcome: str  # "answered" | "busy" | "empty" | "error"
    clip: str = ""
    llm_ttft: float | None = None  # the server's request → first token (ms)
    voice_to_voice: float | None = None  # end of speech → first reply audio at the client (ms)
    server_voice_to_voice: float | None = None  # the same, measured by the server (ms)
    output_tokens: int | None = None  # the reply's length in LLM tokens (it joins the history)
    audio_s: float | None = None  # the reply's audio (s)
    busy: str | None = None  # the ``busy`` reason, if the turn was refused
    error: str | None = None  # why an ``error`` turn failed (an exception's name, or "no reply event")


def turn_row(res: AskResult, session: int, turn: int, t_s: float, clip: str) -> TurnRow:
    """Classify a turn's :class:`~clients.turn.AskResult`: answered if any ``response.done``
    came, else busy, else empty, else an error ("no reply event")."""
    done = [e for e in res.events if e.get("type") == "response.done"]
    row = TurnRow(session, turn, round(t_s, 3), "error", clip)
    if done:
        server = done[-1].get("timings_ms") or {}
        row.outcome, row.llm_ttft = "answered", server.get("llm_ttft")
        row.voice_to_voice, row.server_voice_to_voice = res.timings_ms.get("voice_to_voice"), server.get(
            "voice_to_voice")
        row.output_tokens, row.audio_s = done[-1].get("output_tokens"), done[-1].get("audio_s")
    elif res.busy is not None:
        row.outcome, row.busy = "busy", res.busy.get("reason")
    elif res.empty_reason is not None:
        row.outcome = "empty"
    else:
        row.error = "no reply event"
    return row


def jsonable(x: Any) -> Any:
    """nan → None, recursively through dicts and lists (JSON has no NaN)."""
    if isinstance(x, float) and math.isnan(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, list):
        return [jsonable(v) for v in x]
    return x
