"""What ``voxpipe mic`` shows: committed lines (what you said, what it said, latency, busy,
degraded service) and, on a terminal, one live status line under them, rewritten in place:
the state (listening / you're speaking / thinking / speaking), your words as the partial
transcripts arrive, and the reply's words as they are played. Off a terminal (a pipe, a log)
the same things come as plain lines: ``[state]`` when the state changes, ``  ... partial``
per partial transcript, and the reply one phrase a line as it is played."""

from __future__ import annotations

import asyncio
import math
import shutil
import sys
from typing import TextIO

from clients.client import describe_busy, describe_status

LISTENING, SPEAKING_USER, THINKING, SPEAKING = "listening", "you're speaking", "thinking", "speaking"
"""The states the status line shows."""


def latency_line(timings_ms: dict | None) -> str | None:
    """``response.done``'s ``timings_ms`` in one line, e.g. ``latency: voice-to-voice 950 ms
    (asr 120 ms, first token 300 ms, first audio 210 ms)``; None without timings. A typed turn
    has no voice-to-voice: ``latency: first audio ...``."""
    t = timings_ms or {}

    def ms(key: str) -> str | None:
        v = t.get(key)
        return f"{v:.0f} ms" if isinstance(v, (int, float)) else None

    parts = [f"{label} {ms(k)}" for k, label in (("asr", "asr"), ("llm_ttft", "first token"),
                                                  ("first_audio", "first audio")) if ms(k)]
    head = ms("voice_to_voice")
    if head is None and not parts:
        return None
    if head is None:
        return "latency: " + ", ".join(parts)
    return f"latency: voice-to-voice {head}" + (f" ({', '.join(parts)})" if parts else "")


class Console:
    """What ``voxpipe mic`` tells the user, on ``stream`` (stderr). A ``busy`` gets one line
    with its reason and message; on a terminal a countdown follows on the next line
    ("retry in N s", rewritten in place each second, then "you can try again now"), which
    any later message ends first. Elsewhere (a pipe, a log) the busy line says when to
    retry, once. A ``server.status`` gets one line: what is degraded and what that means
    for the user, or that service is back to normal.

    ``live``: draw the status line in place (default: when ``stream`` is a terminal)."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._countdown: asyncio.Task | None = None
        self.state_name: str | None = None
        self._line = ""  # the status line as last drawn (live)

    # ---- committed lines ----------------------------------------------------------------

    def say(self, text: str) -> None:
        self.end_countdown()
        self._erase()
        print(text, file=self.stream, flush=True)
        self._draw()

    def status(self, ev: dict) -> None:
        """Report a ``server.status`` event (degraded service, or back to normal)."""
        self.say(f"voxpipe mic: {describe_status(ev)}")

    def reply(self, ev: dict) -> None:
        """Report a reply's whole text at once (a ``response.done`` that came without speech
        is marked so)."""
        note = " (text only: speech unavailable)" if ev.get("text_only") else ""
        self.say(f"voxpipe: {ev['text']}{note}")

    def busy(self, ev: dict, *, countdown: bool = True) -> None:
        """Report a ``busy`` event's fields (a countdown needs a running event loop)."""
        retry_s = max(0, ev.get("retry_after_ms") or 0) / 1000
        if not (countdown and self.stream.isatty()):
            self.say(f"voxpipe mic: {describe_busy(ev)}; try again in {retry_s:.1f} s")
            return
        self.say(f"voxpipe mic: {describe_busy(ev)}")
        self._erase()
        self._countdown = asyncio.create_task(self._count_down(retry_s))

    async def _count_down(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while (left := math.ceil(max(0.0, until - loop.time()))) > 0:
            self.stream.write(f"\r  retry in {left} s ")
            self.stream.flush()
            await asyncio.sleep(max(0.05, until - loop.time() - (left - 1)))  # to the next whole second
        self.stream.write("\r  you can try again now\n")
        self.stream.flush()
        if self._countdown is asyncio.current_task():
            self._countdown = None
            self._draw()

    def end_countdown(self) -> None:
        """Stop a countdown still running, ending its line."""
        if self._countdown is not None:
            self._countdown.cancel()
            self._countdown = None
            self.stream.write("\n")

    # ---- the live part ------------------------------------------------------------------

    def state(self, name: str, detail: str = "") -> None:
        """Show state ``name`` with ``detail`` (partial words, the reply so far). Off a
        terminal a ``[name]`` line comes only when the state changes (details have their own
        lines: :meth:`partial`, :meth:`phrase`)."""
        changed = name != self.state_name
        self.state_name = name
        if not self.live:
            if changed:
                print(f"[{name}]", file=self.stream, flush=True)
            return
        self._erase()
        self._line = f"[{name}] {detail}".rstrip()
        self._draw()

    def partial(self, text: str) -> None:
        """A partial transcript of the user's turn."""
        if self.live:
            self.state(SPEAKING_USER, text)
        else:
            self.state(SPEAKING_USER)
            print(f"  ... {text}", file=self.stream, flush=True)

    def phrase(self, text: str) -> None:
        """Off a terminal: a stretch of the reply that has just been played."""
        if text.strip():
            print(f"voxpipe: {text.strip()}", file=self.stream, flush=True)

    def _erase(self) -> None:
        if self.live and self._line and self._countdown is None:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()

    def _draw(self) -> None:
        if not (self.live and self._line) or self._countdown is not None:
            return
        width = max(20, shutil.get_terminal_size((100, 24)).columns - 1)
        line = self._line if len(self._line) <= width else "…" + self._line[-(width - 1):]
        self.stream.write("\r\x1b[2K" + line)
        self.stream.flush()

    def close(self) -> None:
        """End the status line (the terminal's prompt goes on a fresh line)."""
        self.end_countdown()
        self._erase()
        self._line = ""
