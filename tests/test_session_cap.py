"""The session cap (``--max-sessions``): a connection burst admits exactly the cap, every
slot comes back after abrupt disconnects. A real server on loopback over fake stages (the
cap is about connections, not models)."""

from __future__ import annotations

import asyncio
import json

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from pipeline.config import ServerConfig, VoxpipeConfig
from server.app import CLOSE_TRY_AGAIN_LATER, VoxpipeServer
from tests.fakes import fake_engines

CAP, BURST = 50, 300
DEADLINE_S = 120.0


async def try_session(url: str, held: list) -> str:
    """Connect and start a session; 'admitted' (kept open in ``held``), or how it was refused."""
    try:
        ws = await connect(url, open_timeout=DEADLINE_S)
    except InvalidStatus as exc:
        return f"http {exc.response.status_code}"
    try:
        await ws.send(json.dumps({"type": "session.start"}))
        while True:
            ev = json.loads(await ws.recv())
            if ev["type"] == "session.started":
                held.append(ws)
                return "admitted"
    except ConnectionClosed as exc:
        await ws.close()
        return f"close {exc.rcvd.code if exc.rcvd else None}"


async def wait_sessions(app: VoxpipeServer, n: int) -> None:
    for _ in range(int(DEADLINE_S / 0.02)):  # poll: the server frees slots as it notices each close
        if app.sessions == n:
            break
        await asyncio.sleep(0.02)
    assert app.sessions == n


async def test_a_burst_admits_exactly_the_cap_twice_and_abrupt_disconnects_free_every_slot():
    cfg = VoxpipeConfig(server=ServerConfig(max_sessions=CAP))
    app = VoxpipeServer(fake_engines(), cfg)
    app.ready = True
    server = await app.serve("127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"ws://127.0.0.1:{port}/ws"
    try:
        for _ in range(2):
            held: list = []
            outcomes = await asyncio.gather(*(try_session(url, held) for _ in range(BURST)))
            assert outcomes.count("admitted") == CAP, sorted(set(outcomes))
            assert set(outcomes) <= {"admitted", "http 503", f"close {CLOSE_TRY_AGAIN_LATER}"}
            assert app.sessions == CAP
            for ws in held:  # abrupt: no close frame, the TCP connection just goes
                ws.transport.abort()
            await wait_sessions(app, 0)
    finally:
        server.close()
        await server.wait_closed()


async def test_the_default_cap_is_eight_per_llm_batch_slot():
    app = VoxpipeServer(fake_engines(), VoxpipeConfig())
    assert app.max_sessions == 8 * VoxpipeConfig().llm_batch.max_batch_size
