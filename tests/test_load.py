"""Disconnects and bursts against the real server (CASES C09, C10, C12)."""

from __future__ import annotations

import asyncio
import re
import urllib.request

from tests.wsclient import Client


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server["http"] + "/metrics") as r:
        body = r.read().decode()
    m = re.search(rf"^{name} (\S+)$", body, re.M)
    return float(m.group(1))


async def wait_metric(server, name: str, want: float, timeout: float) -> float:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        v = await asyncio.to_thread(metric, server, name)
        if v == want or loop.time() > deadline:
            return v
        await asyncio.sleep(0.05)


async def test_abrupt_disconnect_aborts_generation_and_server_goes_on(server):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "Count from one to two hundred, one number per line."})
        await c.wait_for("response.text.delta", 60)
        assert await wait_metric(server, "voxpipe_llm_running", 1.0, 5) == 1.0
        c.ws.transport.abort()  # TCP reset, no close frame
    assert await wait_metric(server, "voxpipe_llm_running", 0.0, 2.0) == 0.0
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "Say hi."})
        assert (await c.wait_for("response.done", 60))["text"]


async def test_thirty_concurrent_sessions_complete_or_get_busy(server):
    async def one(i: int) -> str:
        async with Client(server["url"]) as c:
            await c.start(sample_rate=16000, output_sample_rate=8000)
            text = "What is the capital of France?" if i % 2 else "Tell me a short story about a brave little fox."
            await c.send_json({"type": "text.input", "text": text})
            ev = await c.wait_for(lambda e: e["type"] == "response.done"
                                  or (e["type"] == "error" and e["code"] == "busy"), 240)
            return ev["type"]

    results = await asyncio.gather(*(one(i) for i in range(30)))
    assert set(results) <= {"response.done", "error"}
    assert results.count("response.done") >= 1
    assert await wait_metric(server, "voxpipe_llm_running", 0.0, 5) == 0.0
    async with Client(server["url"]) as c:  # still serving
        await c.start(sample_rate=16000)
        await c.send_json({"type": "text.input", "text": "Say hi."})
        assert (await c.wait_for("response.done", 60))["text"]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def test_client_that_never_reads_does_not_hurt_others(server):
    """C11: a client asks for a long reply and never reads; memory stays bounded and
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
            t0 = asyncio.get_running_loop().time()
            await c.send_json({"type": "text.input", "text": "What is the capital of France?"})
            done = await c.wait_for("response.done", 60)
            assert "paris" in done["text"].lower()
            assert asyncio.get_running_loop().time() - t0 < 30
        assert rss_mb(server["proc"].pid) - before < 300
    finally:
        lazy.transport.abort()
