"""Disconnects, bursts and a client that never reads, against the real server."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from tests.wsclient import MODEL_DEADLINE_S, Client

pytestmark = pytest.mark.slow  # every test here runs a real server


STEPS = "voxpipe_llm_batch_size_count"  # LLM steps that ran a request


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server["http"] + "/metrics") as r:
        body = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(m.group(1))


async def wait_metric(server, name: str, want: float, deadline_s: float = MODEL_DEADLINE_S) -> float:
    """Poll the gauge ``name`` until it reads ``want``; return its last value (``want``, or
    what it read when ``deadline_s`` ran out)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    while True:
        v = await asyncio.to_thread(metric, server, name)
        if v == want or loop.time() > deadline:
            return v
        await asyncio.sleep(0.05)


async def test_abrupt_disconnect_aborts_generation_and_server_goes_on(server):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "Count from one to two hundred, one number per line."})
        await c.wait_for("response.text.delta")
        assert await wait_metric(server, "voxpipe_llm_running", 1.0) == 1.0
        steps = await asyncio.to_thread(metric, server, STEPS)
        c.ws.transport.abort()  # TCP reset, no close frame
    assert await wait_metric(server, "voxpipe_llm_running", 0.0) == 0.0
    # aborted, not run out: counted in decode steps rather than seconds (a busy machine
    # is slow either way), it stopped well before its max_new_tokens (96) were generated
    after = await asyncio.to_thread(metric, server, STEPS)
    assert after - steps < 48, (steps, after)
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "Say hi."})
        assert (await c.wait_for("response.done"))["text"]


@pytest.mark.timeout(1500)  # thirty replies on a busy two-core machine take a while
async def test_thirty_concurrent_sessions_complete_or_get_busy(server):
    async def one(i: int) -> str:
        async with Client(server["url"]) as c:
            await c.start(sample_rate=16000, output_sample_rate=8000)
            text = "What is the capital of France?" if i % 2 else "Tell me a short story about a brave little fox."
            await c.send_json({"type": "text.input", "text": text})
            ev = await c.wait_for(lambda e: e["type"] in ("response.done", "busy"), 900)
            return ev["type"]

    results = await asyncio.gather(*(one(i) for i in range(30)))
    assert set(results) <= {"response.done", "busy"}
    assert results.count("response.done") >= 1
    assert await wait_metric(server, "voxpipe_llm_running", 0.0) == 0.0
    async with Client(server["url"]) as c:  # still serving
        await c.start(sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "Say hi."})
        assert (await c.wait_for("response.done"))["text"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def test_client_that_never_reads_does_not_hurt_others(server):
    """A client asks for a long reply and never reads; memory stays bounded and
    another session is served normally."""
    import json

    from websockets.asyncio.client import connect

    before = rss_mb(server["proc"].pid)
    lazy = await connect(server["url"], max_queue=1, max_size=None)  # stops reading after 1 message
    try:
        await lazy.send(json.dumps({"type": "session.start", "output_sample_rate": 48000}))
        await lazy.send(json.dumps({"type": "text.input", "text": "Tell me a very long story about the sea."}))
        await asyncio.sleep(2.0)
        async with Client(server["url"]) as c:
            await c.start(sample_rate=16000)
            await c.send_json({"type": "text.input", "text": "What is the capital of France?"})
            # served normally: the reply comes, whole (how soon depends on the machine, so
            # the stuck client shows as a hang here rather than as a latency bound)
            done = await c.wait_for("response.done")
            assert "paris" in done["text"].lower()
        assert rss_mb(server["proc"].pid) - before < 300
    finally:
        lazy.transport.abort()
