"""The Serve ingress's adapter without Ray running: :meth:`VoxpipeServer.handle` (the
websockets server's session loop) over a Starlette ``WebSocket`` fed ASGI messages by hand,
with fake engines. The real thing behind Serve's proxy: tests/test_ray_serve.py."""

from __future__ import annotations

import asyncio
import json
from typing import cast

import pytest

pytest.importorskip("ray.serve", reason="the ray extra is not installed")

from starlette.websockets import WebSocket
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from pipeline.config import ServerConfig, VoxpipeConfig
from server.app import VoxpipeServer
from server.ingress import StarletteSocket
from tests.fakes import fake_engines


class AsgiPeer:
    """The proxy's side of one ASGI WebSocket: what the client sends, what the app sent."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict] = asyncio.Queue()
        self.sent: list[dict] = []
        self.new = asyncio.Event()
        self.inbox.put_nowait({"type": "websocket.connect"})

    async def receive(self) -> dict:
        return await self.inbox.get()

    async def send(self, message: dict) -> None:
        self.sent.append(message)
        self.new.set()

    def client(self, data: str | bytes) -> None:
        key = "bytes" if isinstance(data, bytes) else "text"
        self.inbox.put_nowait({"type": "websocket.receive", key: data})

    def events(self) -> list[dict]:
        return [json.loads(m["text"]) for m in self.sent if m["type"] == "websocket.send" and m.get("text")]

    async def wait_event(self, kind: str, deadline_s: float = 10.0) -> dict:
        async with asyncio.timeout(deadline_s):
            while True:
                found = [e for e in self.events() if e["type"] == kind]
                if found:
                    return found[0]
                self.new.clear()
                await self.new.wait()


async def open_socket(max_size: int = 1 << 20) -> tuple[AsgiPeer, StarletteSocket]:
    peer = AsgiPeer()
    ws = WebSocket({"type": "websocket", "path": "/ws", "headers": [], "client": ("127.0.0.1", 5555)},
                   peer.receive, peer.send)
    await ws.accept()
    return peer, StarletteSocket(ws, max_size)


async def test_the_session_loop_runs_over_a_starlette_websocket():
    app = VoxpipeServer(fake_engines(), VoxpipeConfig())
    app.ready = True
    peer, sock = await open_socket()
    assert sock.remote_address == ("127.0.0.1", 5555)
    session = asyncio.create_task(app.handle(cast(ServerConnection, sock)))
    peer.client(json.dumps({"type": "session.start", "sample_rate": 16000, "format": "pcm16", "channels": 1}))
    await peer.wait_event("session.started")
    peer.client(json.dumps({"type": "text.input", "text": "hello there"}))
    done = await peer.wait_event("response.done")
    assert done["text"]
    assert any(m.get("bytes") for m in peer.sent if m["type"] == "websocket.send")  # reply audio frames
    assert app.sessions == 1
    assert (await sock.ping()).done()  # no ASGI ping: the proxy's uvicorn keeps the client alive
    peer.inbox.put_nowait({"type": "websocket.disconnect", "code": 1001})  # the client goes
    await asyncio.wait_for(session, 10)
    assert app.sessions == 0
    with pytest.raises(ConnectionClosed):
        await sock.send("late")  # as websockets: sending on a closed connection raises
    with pytest.raises(ConnectionClosed):
        await sock.ping()


async def test_session_end_closes_normally_and_close_is_idempotent():
    app = VoxpipeServer(fake_engines(), VoxpipeConfig())
    app.ready = True
    peer, sock = await open_socket()
    session = asyncio.create_task(app.handle(cast(ServerConnection, sock)))
    peer.client(json.dumps({"type": "session.end"}))
    await asyncio.wait_for(session, 10)
    closes = [m for m in peer.sent if m["type"] == "websocket.close"]
    assert len(closes) == 1 and closes[0]["code"] == 1000
    await sock.close(1011, "again")  # a second close sends nothing
    assert len([m for m in peer.sent if m["type"] == "websocket.close"]) == 1


async def test_a_frame_over_max_message_bytes_closes_with_1009():
    app = VoxpipeServer(fake_engines(), VoxpipeConfig(server=ServerConfig(max_message_bytes=1000)))
    app.ready = True
    peer, sock = await open_socket(max_size=1000)
    session = asyncio.create_task(app.handle(cast(ServerConnection, sock)))
    peer.client(b"\0" * 1001)
    await asyncio.wait_for(session, 10)
    assert [m["code"] for m in peer.sent if m["type"] == "websocket.close"] == [1009]
    assert app.sessions == 0
