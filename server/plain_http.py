"""The websockets server's plain HTTP answers (the web page, ``/healthz``, ``/metrics``, the
edge's refusals) given from another HTTP stack: a Ray Serve ingress (server/ingress.py) or a
kept-alive connection of the HTTP API (server/openai_api.py).
:meth:`~server.types.HttpHost.process_request` (:class:`~server.app.VoxpipeServer`'s) needs
only a connection's ``respond`` and ``remote_address``."""

from __future__ import annotations

import http
from collections.abc import Iterable
from typing import Any, cast

from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.http11 import Request as WsRequest
from websockets.http11 import Response as WsResponse

from .types import HttpHost


class PlainConnection:
    """What :meth:`HttpHost.process_request` uses of a websockets connection."""

    def __init__(self, remote_address: Any) -> None:
        self.remote_address = remote_address

    def respond(self, status: http.HTTPStatus, text: str) -> WsResponse:
        return WsResponse(status.value, status.phrase, Headers([("Content-Type", "text/plain; charset=utf-8")]),
                          text.encode())


def plain_answer(server: HttpHost, path: str, query: str, raw_headers: Iterable[tuple[bytes, bytes]],
                 remote: Any) -> WsResponse | None:
    """``server``'s answer to a GET of ``path`` (``query``: the raw query string;
    ``raw_headers``: ASGI's latin-1 header pairs; ``remote``: the client's address), or None
    where it would go on to a WebSocket upgrade (``/ws``)."""
    headers = Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw_headers])
    request = WsRequest(f"{path}?{query}" if query else path, headers)
    return server.process_request(cast(ServerConnection, PlainConnection(remote)), request)
