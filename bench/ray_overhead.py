"""What a Ray Serve deployment handle adds to a call, on loopback (``voxpipe bench ray``).

A trivial echo deployment (no model) is called through its handle and, for reference,
the same object's method directly in this process; the median of ``--calls`` sequential
calls is the per-call latency. Payloads are what the stages pass: nothing, a streaming
ASR request (1 s and 5 s of 16 kHz float32 audio), and a reply streamed in deltas (per
delta). The table says what the handle costs per call and per second of a session's ASR
(one decode a second).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np

from audio.pcm import RATE
from pipeline.asr.types import DecodeRequest


class Echo:
    """The deployment: returns what it is given; streams ``n`` short deltas."""

    async def echo(self, item: object) -> object:
        return item

    async def deltas(self, n: int) -> AsyncIterator[str]:
        for i in range(n):
            yield f"w{i} "


async def _median_ms(call: Callable[[], Awaitable[object]], calls: int) -> tuple[float, float]:
    """(median, p90) of ``calls`` sequential awaits of ``call()`` in ms, after 10 warm-up calls."""
    for _ in range(10):
        await call()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        await call()
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


async def _consume(stream: AsyncIterator[str]) -> int:
    n = 0
    async for _ in stream:
        n += 1
    return n


async def measure(handle, calls: int, deltas: int) -> list[tuple[str, float, float, float]]:
    """Rows ``(call, direct median ms, handle median ms, handle p90 ms)``."""
    local = Echo()
    payloads = {"empty call": None,
                "ASR request, 1 s audio (64 KB)": DecodeRequest(np.zeros(RATE, np.float32)),
                "ASR request, 5 s audio (320 KB)": DecodeRequest(np.zeros(5 * RATE, np.float32)),
                "ASR request, 20 s audio (1.3 MB: the buffer's cap)": DecodeRequest(np.zeros(20 * RATE, np.float32))}
    rows = []
    for name, item in payloads.items():
        direct, _ = await _median_ms(functools.partial(local.echo, item), calls)
        remote, p90 = await _median_ms(functools.partial(handle.echo.remote, item), calls)
        rows.append((name, direct, remote, p90))
    streaming = handle.options(stream=True)

    async def direct_reply() -> int:
        return await _consume(local.deltas(deltas))

    async def remote_reply() -> int:
        return await _consume(streaming.deltas.remote(deltas))

    direct, _ = await _median_ms(direct_reply, max(10, calls // 10))
    remote, p90 = await _median_ms(remote_reply, max(10, calls // 10))
    rows.append((f"reply of {deltas} deltas, per delta", direct / deltas, remote / deltas, p90 / deltas))
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--calls", type=int, default=200, help="sequential calls per row (median)")
    p.add_argument("--deltas", type=int, default=50, help="deltas per streamed reply")
    p.add_argument("--address", default=None,
                   help="a Ray cluster to use (default: start a local one with 2 CPUs, no dashboard)")


def main(args) -> int:
    import ray
    from ray import serve

    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(proxy_location="Disabled")
        echo = serve.deployment(name="echo", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=8)(Echo)
        handle = serve.run(echo.bind(), name="voxpipe-bench-echo", route_prefix=None)
        rows = asyncio.run(measure(handle, args.calls, args.deltas))
        serve.delete("voxpipe-bench-echo")
    finally:
        ray.shutdown()
    print(f"Ray Serve handle overhead on loopback, median of {args.calls} sequential calls (ms)")
    print("| call | direct (µs) | through the handle | handle p90 | added per call |")
    print("|---|---|---|---|---|")
    for name, direct, remote, p90 in rows:
        print(f"| {name} | {direct * 1000:.1f} | {remote:.2f} | {p90:.2f} | {remote - direct:.2f} |")
    added = rows[1][2] - rows[1][1]
    print(f"each streaming ASR decode (1 s of audio) waits {added:.1f} ms longer through the handle: at one decode "
          f"a second per session, {added / 10:.2f} % of the session's time")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.ray_overhead", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
