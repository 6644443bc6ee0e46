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
