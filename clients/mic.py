"""``voxpipe mic``: talk to a voxpipe server with the local microphone and speaker."""

from __future__ import annotations

import asyncio
import json
import sys

from server.protocol import parse_audio_frame

RATE = 16000
OUT_RATE = 22050


async def _session(url: str, input_device, output_device) -> None:
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

    async with connect(url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": RATE, "format": "pcm16",
                                  "channels": 1, "output_sample_rate": OUT_RATE}))
        player = Player(OUT_RATE, output_device)
        player.start()
        mic = open_microphone(RATE, on_pcm, input_device)
        print("listening — speak; Ctrl+C to quit", file=sys.stderr)

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
                    print(f"you: {ev['text']}", file=sys.stderr)
                elif kind == "response.done":
                    print(f"voxpipe: {ev['text']}", file=sys.stderr)
                elif kind == "response.cancelled":
                    cancelled.add(ev["response_id"])
                    player.flush()
                elif kind == "busy":
                    retry_s = ev.get("retry_after_ms", 0) / 1000
                    print(f"voxpipe is busy ({ev['reason']}): try again in {retry_s:.1f} s", file=sys.stderr)
                elif kind == "error":
                    print(f"error {ev['code']}: {ev['message']}", file=sys.stderr)
        finally:
            sender.cancel()
            mic.stop()
            player.close()


def run_mic(url: str, *, input_device=None, output_device=None) -> int:
    """Run the microphone client until Ctrl+C; returns an exit status."""
    from audio.devices import DeviceError

    try:
        asyncio.run(_session(url, input_device, output_device))
    except KeyboardInterrupt:
        return 0
    except DeviceError as exc:
        print(f"voxpipe mic: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"voxpipe mic: no voxpipe server at {url} ({exc})", file=sys.stderr)
        return 3
    return 0
