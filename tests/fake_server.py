"""The real voxpipe server (:class:`server.app.VoxpipeServer`: edge checks, budgets, the
session loop) over fake model stages, on loopback in this process — for tests about the
edge and connections, not models. :func:`fake_server` runs it on the test's event loop;
:func:`fake_server_thread` on a loop of its own (for synchronous tests: a browser)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from server.app import VoxpipeServer
from tests.fakes import fake_engines


@dataclass(slots=True)
class Running:
    """A listening server: ``app``, ``port``, and its ``ws``/``http`` base URLs."""

    app: VoxpipeServer
    port: int

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/ws"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@asynccontextmanager
async def fake_server(cfg: VoxpipeConfig | None = None, engines: Engines | None = None,
                      port: int = 0) -> AsyncIterator[Running]:
    """Serve ``cfg`` (default config) over ``engines`` (default: :func:`fake_engines`) on
    127.0.0.1, ``port`` (0: a free one)."""
    app = VoxpipeServer(engines or fake_engines(), cfg or VoxpipeConfig())
    app.ready = True
    server = await app.serve("127.0.0.1", port)
    try:
        yield Running(app, server.sockets[0].getsockname()[1])
    finally:
        server.close()
        await server.wait_closed()
        await app.stop_tasks()


@contextmanager
def fake_server_thread(cfg: VoxpipeConfig | None = None, engines: Engines | None = None,
                       port: int = 0) -> Iterator[Running]:
    """:func:`fake_server` on an event loop in a daemon thread, until the block ends."""
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    box: list[Running] = []
    ready = threading.Event()

    async def main() -> None:
        async with fake_server(cfg, engines, port) as running:
            box.append(running)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    if not ready.wait(60):
        raise TimeoutError("fake server did not start")
    try:
        yield box[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
