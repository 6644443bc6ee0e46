"""Why sessions ended, as ``voxpipe_sessions_closed_total{reason}`` counts them: a client's
close and a server's shutdown are told apart. The real server over fake stages (this is about
connections, not models)."""

from __future__ import annotations

import asyncio
import json

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from pipeline.metrics import REGISTRY
from tests.fake_server import fake_server

DEADLINE_S = 60.0


def closed(reason: str) -> float:
    return REGISTRY.get_sample_value("voxpipe_sessions_closed_total", {"reason": reason}) or 0.0


async def started(url: str):
    ws = await connect(url, open_timeout=DEADLINE_S)
    await ws.send(json.dumps({"type": "session.start"}))
    while json.loads(await asyncio.wait_for(ws.recv(), DEADLINE_S))["type"] != "session.started":
        pass
    return ws


async def until(pred) -> None:
    for _ in range(int(DEADLINE_S / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_a_client_close_counts_as_client_and_a_shutdown_as_server():
    client0, server0 = closed("client"), closed("server")
    async with fake_server() as running:
        ws = await started(running.ws)
        await ws.close()
        await until(lambda: running.app.sessions == 0)
        assert (closed("client"), closed("server")) == (client0 + 1, server0)
        held = await started(running.ws)
    await until(lambda: closed("server") == server0 + 1)  # the block's end shut the server down
    assert closed("client") == client0 + 1
    try:
        await asyncio.wait_for(held.recv(), DEADLINE_S)
        raise AssertionError("the session outlived its server")
    except ConnectionClosed as exc:
        assert exc.rcvd is not None and exc.rcvd.code == 1001  # going away
