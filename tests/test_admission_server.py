"""Admission on the real server with the default SLO (2 s): a burst of typed turns gets
``busy`` for what cannot be answered in time, before any reply starts for it; every
started response ends; the server's counters equal what the clients saw."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from tests.conftest import running_server
from tests.wsclient import MODEL_DEADLINE_S, Client

pytestmark = pytest.mark.slow  # a real server with the real models

BURST = 32


def counters(http: str) -> dict[tuple[str, str], float]:
    with urllib.request.urlopen(http + "/metrics") as r:
        body = r.read().decode()
    found = re.findall(r'^voxpipe_admissions_total\{decision="(\w+)",reason="(\w*)"\} (\S+)$', body, re.M)
    return {(d, reason): float(v) for d, reason, v in found}


@pytest.mark.timeout(1800)
async def test_a_burst_of_turns_is_answered_or_refused_at_once_and_the_counts_agree(tmp_path):
    with running_server(tmp_path / "serve.log", lenient=False) as (port, _):
        url, http = f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}"
        before = await asyncio.to_thread(counters, http)
        clients = [Client(url) for _ in range(BURST)]
        for c in clients:
            await c.__aenter__()
        try:
            for c in clients:
                await c.start(sample_rate=16000, output_sample_rate=8000)
            await asyncio.gather(*(c.send_json({"type": "text.input", "text": "Tell me about the sea."})
                                   for c in clients))
            outcomes = await asyncio.gather(*(c.wait_for(lambda e: e["type"] in ("busy", "response.done",
                                                                                 "response.cancelled"),
                                                         MODEL_DEADLINE_S * 3) for c in clients))
            kinds = [o["type"] for o in outcomes]
            assert "busy" in kinds, "a burst of 32 typed turns on 8 batch slots must refuse some"
            assert "response.done" in kinds, "the first turns must be answered"
            for c, o in zip(clients, outcomes, strict=True):
                seen = [e["type"] for e in c.conv.events]
                if o["type"] == "busy":
                    assert o["reason"] in ("queue", "memory", "stage") and o["retry_after_ms"] > 0
                    assert "response.started" not in seen  # refused before any reply started
                else:  # a started response ends with done or cancelled
                    assert seen.count("response.started") == 1
            after = await asyncio.to_thread(counters, http)
            refused = sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == "refused")
            admitted = after.get(("admitted", ""), 0.0) - before.get(("admitted", ""), 0.0)
            assert refused == kinds.count("busy")
            assert admitted == BURST - kinds.count("busy")
        finally:
            for c in clients:
                await c.__aexit__(None, None, None)
