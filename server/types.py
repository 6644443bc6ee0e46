"""What the HTTP side of the server uses of :class:`server.app.VoxpipeServer`, as protocols:
the OpenAI-compatible API (:mod:`server.openai_api`) and the plain HTTP answers given from
another HTTP stack (:mod:`server.plain_http`) depend on these shapes, not on the server that
composes them (``VoxpipeServer`` satisfies both)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from websockets.asyncio.server import ServerConnection
    from websockets.http11 import Request, Response

    from pipeline.config import VoxpipeConfig
    from pipeline.engines import Engines
    from pipeline.serving.admission import Admission
    from pipeline.serving.governor import Governor
    from server.edge import EdgeGuard


class HttpHost(Protocol):
    """A server that answers plain HTTP requests (the web page, ``/healthz``, ``/metrics``,
    the edge's refusals) as the websockets server's ``process_request`` hook does."""

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """The answer to ``request`` (``connection``: only its ``respond`` and
        ``remote_address`` are used), or None to go on to the WebSocket upgrade."""
        ...


class ApiHost(HttpHost, Protocol):
    """A server whose LLM the HTTP API serves: its loaded stages, configuration, admission,
    service level (governor) and edge checks, and whether it is ready (warmed up)."""

    engines: Engines
    cfg: VoxpipeConfig
    admission: Admission
    governor: Governor
    edge: EdgeGuard
    ready: bool


class SessionHost(ApiHost, Protocol):
    """A server that opens voice sessions on another edge than its ``/ws`` handler (the
    WebRTC endpoint, :mod:`server.webrtc`): what :class:`ApiHost` gives, and the count of
    open sessions, which every edge shares under one cap (``max_sessions``)."""

    sessions: int
    max_sessions: int
