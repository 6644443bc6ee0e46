"""A stand-in voxpipe server for client tests: no models, every answer scripted.

It serves the web demo (``web/``) over HTTP like the real server, and on ``/ws`` either
refuses the session the way the session cap does (``refuse="http"``: HTTP 503 with
``Retry-After`` before the upgrade; ``refuse="close"``: close code 1013 right after it) or
answers ``session.start`` with ``session.started`` (then the ``on_start`` frames: a
``server.status`` sent when the session starts on a degraded server) and every turn
(``input.end`` or ``text.input``) with the scripted ``turn`` frames — or, given ``turns``,
the n-th turn with the n-th script (the last one again for any turn after it). Events are the real event classes,
encoded by the real server's encoder, so the wire format is the server's.

Audio: the client's is ignored (Opus or PCM alike); the scripted reply audio is PCM16, and
``session.started`` says so (``output.format`` ``pcm16``) whatever the client asked. With
``opus=False`` it is a server from before Opus: a ``session.start`` asking for Opus gets
``error`` ``bad_event`` (as pydantic words it there) and no ``session.started``.
"""

from __future__ import annotations

import asyncio
import http
import json
import mimetypes
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from pipeline.session import events as ev
from server.protocol import encode_event
from tests.conftest import ROOT

WEB_DIR = ROOT / "web"
CLOSE_TRY_AGAIN_LATER = 1013  # server.app's session-cap close code (importing server.app loads torch)
Frame = ev._ServerEvent | bytes


def server_event(cls: type[ev._ServerEvent], **fields) -> ev._ServerEvent:
    """A server event of class ``cls``; a per-turn event gets ``turn_id`` 1 unless given."""
    if "turn_id" in cls.model_fields:
        fields.setdefault("turn_id", 1)
    return cls(**fields)


class ScriptedServer:
    """Run with :func:`scripted_server`; ``url`` (ws) and ``http`` are set once it listens."""

    def __init__(self, turn: Sequence[Frame] = (), refuse: Literal["http", "close"] | None = None,
                 retry_after_s: int = 5, max_sessions: int = 1, on_start: Sequence[Frame] = (),
                 turns: Sequence[Sequence[Frame]] | None = None, opus: bool = True) -> None:
        self.turn, self.refuse = list(turn), refuse
        self.on_start = list(on_start)
        self.turns = [list(t) for t in turns] if turns else [self.turn]
        self.turns_answered = 0
        self.retry_after_s, self.max_sessions = retry_after_s, max_sessions
        self.opus = opus
        self.received: list[dict] = []  # every JSON event a client sent
        self.url = self.http = ""

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/ws":
            if self.refuse == "http":
                resp = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                          f"server full: {self.max_sessions} sessions (--max-sessions)\n")
                resp.headers["Retry-After"] = str(self.retry_after_s)
                return resp
            return None
        file = (WEB_DIR / ("index.html" if path == "/" else path.lstrip("/"))).resolve()
        if not (file.is_file() and WEB_DIR in file.parents):
            return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")
        body = file.read_bytes()
        ctype = "text/javascript" if file.suffix == ".js" else mimetypes.guess_type(file.name)[0] or "text/plain"
        return Response(200, "OK", Headers([("Content-Type", ctype), ("Content-Length", str(len(body))),
                                            ("Cache-Control", "no-store")]), body)

    async def handle(self, ws: ServerConnection) -> None:
        if self.refuse == "close":
            await ws.close(CLOSE_TRY_AGAIN_LATER, f"server full: {self.max_sessions} sessions")
            return
        async for msg in ws:
            if isinstance(msg, bytes):
                continue  # audio: heard and ignored
            event = json.loads(msg)
            self.received.append(event)
            if event["type"] == "session.start" and not self.opus and "opus" in (
                    event.get("format"), event.get("output_format")):
                await ws.send(encode_event(ev.Error(
                    code="bad_event", message="invalid session.start: format: Input should be 'pcm16' or 'f32'")))
            elif event["type"] == "session.start":
                fmt = ev.AudioFormat(sample_rate=event.get("sample_rate", 16000),
                                     format=event.get("format", "pcm16"), channels=event.get("channels", 1))
                out = ev.AudioFormat(sample_rate=event.get("output_sample_rate", 24000), format="pcm16", channels=1)
                await ws.send(encode_event(ev.SessionStarted(session_id="scripted", input=fmt, output=out)))
                await self.send_frames(ws, self.on_start)
            elif event["type"] in ("input.end", "text.input"):
                script = self.turns[min(self.turns_answered, len(self.turns) - 1)]
                self.turns_answered += 1
                await self.send_frames(ws, script)

    @staticmethod
    async def send_frames(ws: ServerConnection, frames: Sequence[Frame]) -> None:
        for frame in frames:
            await ws.send(frame if isinstance(frame, bytes) else encode_event(frame))


@contextmanager
def scripted_server(**kwargs) -> Iterator[ScriptedServer]:
    """A :class:`ScriptedServer` on a free loopback port, in its own thread and event loop,
    for the duration of the block."""
    srv = ScriptedServer(**kwargs)
    listening = threading.Event()
    state: dict = {}

    async def main() -> None:
        stop = asyncio.Event()
        state["loop"], state["stop"] = asyncio.get_running_loop(), stop
        async with serve(srv.handle, "127.0.0.1", 0, process_request=srv.process_request) as server:
            port = server.sockets[0].getsockname()[1]
            srv.url, srv.http = f"ws://127.0.0.1:{port}/ws", f"http://127.0.0.1:{port}"
            listening.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    if not listening.wait(60):
        raise RuntimeError("the scripted server did not start")
    try:
        yield srv
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(60)
