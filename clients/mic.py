"""``voxpipe mic``: talk to a voxpipe server with the local microphone and speaker."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from typing import TextIO

from clients.client import EXIT_DENIED, access_denied, auth_headers, describe_busy, describe_status, refused_session
from server.protocol import parse_audio_frame

RATE = 16000
OUT_RATE = 22050
EXIT_BUSY = 5
"""Exit status when the server refused the session (its session cap)."""


class Console:
    """What ``voxpipe mic`` tells the user, on ``stream`` (stderr). A ``busy`` gets one line
    with its reason and message; on a terminal a countdown follows on the next line
    ("retry in N s", rewritten in place each second, then "you can try again now"), which
    any later message ends first. Elsewhere (a pipe, a log) the busy line says when to
    retry, once. A ``server.status`` gets one line: what is degraded and what that means
    for the user, or that service is back to normal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self._countdown: asyncio.Task | None = None

    def say(self, text: str) -> None:
        self.end_countdown()
        print(text, file=self.stream, flush=True)

    def status(self, ev: dict) -> None:
        """Report a ``server.status`` event (degraded service, or back to normal)."""
        self.say(f"voxpipe mic: {describe_status(ev)}")

    def reply(self, ev: dict) -> None:
        """Report a ``response.done``: the reply's text, marked when it came without speech."""
        note = " (text only: speech unavailable)" if ev.get("text_only") else ""
        self.say(f"voxpipe: {ev['text']}{note}")

    def busy(self, ev: dict, *, countdown: bool = True) -> None:
        """Report a ``busy`` event's fields (a countdown needs a running event loop)."""
        retry_s = max(0, ev.get("retry_after_ms") or 0) / 1000
        if not (countdown and self.stream.isatty()):
            self.say(f"voxpipe mic: {describe_busy(ev)}; try again in {retry_s:.1f} s")
            return
        self.say(f"voxpipe mic: {describe_busy(ev)}")
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

    def end_countdown(self) -> None:
        """Stop a countdown still running, ending its line."""
        if self._countdown is not None:
            self._countdown.cancel()
            self._countdown = None
            self.stream.write("\n")


async def _session(url: str, input_device, output_device, console: Console, token: str | None = None) -> None:
    from websockets.asyncio.client import connect

    from audio.devices import Player, open_microphone

    loop = asyncio.get_running_loop()
    mic_q: asyncio.Queue[bytes] = asyncio.Queue(maxsize=100)

    def on_pcm(data: bytes) -> None:
        def put() -> None:
            if mic_q.full():
                mic_q.get_nowait()  # drop the oldest 20 ms rather than grow
            mic_q.put_nowait(data)

        loop.call_soon_threadsafe(put)

    async with connect(url, max_size=None, additional_headers=auth_headers(token)) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": RATE, "format": "pcm16",
                                  "channels": 1, "output_sample_rate": OUT_RATE}))
        player = Player(OUT_RATE, output_device)
        player.start()
        mic = open_microphone(RATE, on_pcm, input_device)
        console.say("listening — speak; Ctrl+C to quit")

        async def send() -> None:
            while True:
                await ws.send(await mic_q.get())

        sender = asyncio.create_task(send())
        cancelled: set[int] = set()
        try:
            async for msg in ws:
                if isinstance(msg, bytes):
                    rid, pcm = parse_audio_frame(msg)
                    if rid not in cancelled:
                        player.push(pcm)
                    continue
                ev = json.loads(msg)
                kind = ev["type"]
                if kind == "transcript.final":
                    console.say(f"you: {ev['text']}")
                elif kind == "response.done":
                    console.reply(ev)
                elif kind == "response.cancelled":
                    cancelled.add(ev["response_id"])
                    player.flush()
                elif kind == "busy":
                    console.busy(ev)
                elif kind == "server.status":
                    console.status(ev)
                elif kind == "error":
                    console.say(f"error {ev['code']}: {ev['message']}")
        finally:
            console.end_countdown()
            sender.cancel()
            mic.stop()
            player.close()


def run_mic(url: str, *, input_device=None, output_device=None, token: str | None = None) -> int:
    """Run the microphone client until Ctrl+C; returns an exit status (0; 2: no audio
    device; 3: no server; 5: the server refused the session, busy ``sessions``; 6: the
    server refused this client, HTTP 401/403). ``token``: the server's bearer token."""
    from websockets.exceptions import WebSocketException

    from audio.devices import DeviceError

    console = Console()
    try:
        asyncio.run(_session(url, input_device, output_device, console, token))
    except KeyboardInterrupt:
        return 0
    except WebSocketException as exc:
        denied = access_denied(exc)
        if denied is not None:
            console.say(f"voxpipe mic: {denied}")
            return EXIT_DENIED
        busy = refused_session(exc)
        if busy is None:
            console.say(f"voxpipe mic: {exc}")
            return 1
        console.busy(busy, countdown=False)  # the session is over: nothing to count down for
        return EXIT_BUSY
    except DeviceError as exc:
        print(f"voxpipe mic: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"voxpipe mic: no voxpipe server at {url} ({exc})", file=sys.stderr)
        return 3
    return 0
