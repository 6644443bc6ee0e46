"""One port, two HTTP stacks: the ``/v1/...`` HTTP API goes to uvicorn's h11 protocol,
everything else to websockets as before.

Why: the server is built on ``websockets`` (``/ws`` sessions, and plain GET answers through
``process_request``: the web page, ``/healthz``, ``/metrics``). Its HTTP parser accepts
only a GET without a body (``websockets.http11.Request.parse``) and sends a response whole,
so it cannot take ``POST /v1/chat/completions`` nor stream Server-Sent Events. Rather than a
second port (which every client, proxy and firewall would have to learn), each accepted
connection is a :class:`SniffingConnection` (websockets' ``create_connection`` hook): it
holds back websockets' ``connection_made`` — which would start the handshake handler — until
the first line of the request has arrived, then

- a path under ``/v1/`` other than ``/v1/realtime`` (the OpenAI Realtime WebSocket, which
  websockets serves), or a method other than GET (answered 405 off the API), is handed to a
  uvicorn ``H11Protocol`` running the ASGI app of :mod:`server.openai_api`
  (``transport.set_protocol``; the buffered bytes are replayed): no websockets handler ever
  starts for it;
- anything else (or a first line longer than :data:`MAX_REQUEST_LINE`, or a client that
  closes before sending one) goes on to websockets exactly as without the sniffing.

A client that sends no complete first line within :data:`SNIFF_TIMEOUT_S` is dropped (as
websockets' ``open_timeout`` would). The HTTP connections are the front's, not uvicorn
``Server``'s (none runs): :meth:`HttpFront.attach` makes the websockets server's ``close``
close them too — idle keep-alive connections at once, requests in progress cancelled (an
aborted generation frees its batch slot) — and its ``wait_closed`` wait for that.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar, Protocol

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState
from websockets.asyncio.server import Server, ServerConnection

from pipeline import metrics

logger = logging.getLogger(__name__)


class Closable(Protocol):
    """Something the websockets server's ``close()`` closes too (:func:`close_along`)."""

    closing: bool

    async def aclose(self) -> None: ...


def close_along(server: Server, part: Closable, name: str) -> None:
    """Make ``server.close()`` start ``part.aclose()`` too (unless ``part`` is already
    closing), as a task named ``name`` that ``server.wait_closed()`` waits for (websockets'
    close waits for its handler tasks)."""
    close = server.close

    def close_both(*args: Any, **kwargs: Any) -> None:
        if not part.closing:
            task = asyncio.get_running_loop().create_task(part.aclose(), name=name)
            server.handler_tasks.add(task)
            task.add_done_callback(server.handler_tasks.discard)
        close(*args, **kwargs)

    server.close = close_both  # type: ignore[method-assign]

MAX_REQUEST_LINE = 8192
"""Bytes of a connection's first line read before deciding: a longer line goes to websockets
(whose parser refuses it as it always did)."""
SNIFF_TIMEOUT_S = 10.0
"""A connection that sends no complete first line within this long is aborted (websockets'
default ``open_timeout``)."""
MAX_HEADER_BYTES = 16 * 1024
"""Largest request head the HTTP API takes: one still incomplete past this is answered 400
and closed (h11's limit), a complete one with more header bytes 431 (server/openai_api.py)."""
REQUEST_HEAD_TIMEOUT_S = 10.0
"""A connection of the HTTP API that makes no progress on a request head (none yet, or the
next one on a kept-alive connection) for this long is aborted: a slowloris client sending a
header line every few seconds holds nothing for long. Checked every this-many seconds, so it
goes after 10–20 s."""
BODY_TIMEOUT_S = 10.0
"""The whole request body must arrive within this long after its head (server/openai_api.py
answers 408): a body that stops short holds nothing for long."""
KEEP_ALIVE_S = 5
"""An idle keep-alive HTTP connection is closed after this long (uvicorn's default)."""
CLOSE_GRACE_S = 2.0
"""At server close, how long cancelled requests get to finish before their sockets are aborted."""


_FULL_BODY = (b'{"error": {"message": "server full: too many HTTP API connections open; try again shortly", '
              b'"type": "server_busy", "code": "server_full"}}')
FULL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 5\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY)
"""The answer to a connection over :attr:`HttpFront.max_connections` (the OpenAI error shape)."""


def is_http_api(request_line: bytes) -> bool:
    """Whether a request's first line (``METHOD TARGET HTTP/x.y``, no CRLF) is for the
    HTTP API: an origin-form target whose path is under ``/v1/`` and is not ``/v1/realtime``,
    or any method but GET (websockets' parser takes a GET only: a ``POST /elsewhere`` with a
    body got no answer at all; the API's front answers it 405)."""
    parts = request_line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return False
    path = parts[1].partition(b"?")[0]
    return parts[0] != b"GET" or (path.startswith(b"/v1/") and path.rstrip(b"/") != b"/v1/realtime")


class HttpFront:
    """The HTTP API's side of the port: a loaded uvicorn configuration for ``app`` and the
    connections handed to it.

    Args:
        app: the ASGI application (:func:`server.openai_front.openai_app`).
        max_connections: HTTP API connections open at once at most (0: no cap); one more is
            answered 503 with ``Retry-After`` and closed before it costs anything.
    """

    def __init__(self, app: Any, max_connections: int = 0) -> None:
        self.max_connections = max_connections
        # no lifespan, no websockets in uvicorn, no proxy-header rewriting, our own logging
        self.config = uvicorn.Config(app, lifespan="off", http="h11", ws="none", log_config=None, access_log=False,
                                     proxy_headers=False, server_header=False, date_header=False,
                                     timeout_keep_alive=KEEP_ALIVE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
        self.config.load()
        self.state = ServerState()  # .connections: live H11Protocols; .tasks: running ASGI requests
        self.app_state: dict[str, Any] = {}
        self.sniffing: set[SniffingConnection] = set()
        self.closing = False

    def connection_class(self) -> type[ServerConnection]:
        """A :class:`SniffingConnection` class bound to this front, for ``serve(create_connection=...)``."""
        front = self

        class Bound(SniffingConnection):
            pass

        Bound.front = front
        return Bound

    def take(self, transport: asyncio.Transport, data: bytes) -> None:
        """Serve the connection ``transport`` with uvicorn from now on; ``data``: the bytes
        read so far."""
        # a refused connection goes to a plain protocol first: the sniffing websockets protocol
        # never started, and closing the transport must not reach its connection_lost (a traceback)
        if self.closing:
            transport.set_protocol(asyncio.Protocol())
            transport.abort()
            return
        if self.max_connections and len(self.state.connections) >= self.max_connections:
            transport.set_protocol(asyncio.Protocol())
            metrics.HTTP_API_REQUESTS.labels("connection_cap", "503").inc()  # a count, not a log line per flood
            logger.debug("HTTP API: %d connections open (the cap): refused one from %s", self.max_connections,
                         transport.get_extra_info("peername"))
            transport.write(FULL_RESPONSE)
            transport.close()
            return
        proto = H11Protocol(self.config, self.state, self.app_state)
        transport.set_protocol(proto)
        proto.connection_made(transport)
        proto.data_received(data)
        self._watch_head(proto, transport, None)

    def _watch_head(self, proto: H11Protocol, transport: asyncio.Transport, seen: object) -> None:
        """Every :data:`REQUEST_HEAD_TIMEOUT_S`: abort the connection if it waited for a
        request head (no request yet, or the last one answered) at the last check too, on the
        same request cycle — no progress in that time."""
        if transport.is_closing():
            return
        cycle = proto.cycle
        waiting = cycle is None or cycle.response_complete
        key = ("waiting", id(cycle)) if waiting else None
        if key is not None and key == seen:
            logger.info("HTTP API connection from %s sent no complete request in %.0f s: closed",
                        transport.get_extra_info("peername"), REQUEST_HEAD_TIMEOUT_S)
            transport.abort()
            return
        asyncio.get_running_loop().call_later(REQUEST_HEAD_TIMEOUT_S, self._watch_head, proto, transport, key)

    def attach(self, server: Server) -> None:
        """Make ``server.close()`` close this front's connections as well, and
        ``server.wait_closed()`` wait for them."""
        close_along(server, self, "voxpipe-http-close")

    async def aclose(self) -> None:
        """Close every connection: undecided ones and idle keep-alive ones at once, requests
        in progress cancelled; sockets still open after :data:`CLOSE_GRACE_S` are aborted."""
        self.closing = True
        for conn in list(self.sniffing):
            conn.drop()
        for proto in list(self.state.connections):
            if isinstance(proto, H11Protocol):
                proto.shutdown()
        tasks = list(self.state.tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_GRACE_S)
        for proto in list(self.state.connections):
            transport = getattr(proto, "transport", None)
            if transport is not None:
                transport.abort()
        if self.state.connections:
            await asyncio.sleep(0)  # let connection_lost run


class SniffingConnection(ServerConnection):
    """A websockets connection that starts only once the request's first line shows it is
    not for the HTTP API (see the module docstring). Subclassed per server by
    :meth:`HttpFront.connection_class`."""

    front: ClassVar[HttpFront]

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._sniff_transport: asyncio.Transport = transport  # type: ignore[assignment]
        self._sniffed = bytearray()
        self._decided = False
        self._sniff_timer: asyncio.TimerHandle | None = self.loop.call_later(SNIFF_TIMEOUT_S, self.drop)
        self.front.sniffing.add(self)

    def data_received(self, data: bytes) -> None:
        if self._decided:
            super().data_received(data)
            return
        self._sniffed += data
        end = self._sniffed.find(b"\n")
        if end == -1 and len(self._sniffed) <= MAX_REQUEST_LINE:
            return
        line = bytes(self._sniffed[:end]).rstrip(b"\r") if 0 <= end <= MAX_REQUEST_LINE else b""
        buffered = bytes(self._sniffed)
        self._decide()
        if is_http_api(line):
            self.front.take(self._sniff_transport, buffered)
            return
        super().connection_made(self._sniff_transport)
        super().data_received(buffered)

    def eof_received(self) -> None:
        if not self._decided:  # closed before a whole first line: websockets answers as it always did
            buffered = bytes(self._sniffed)
            self._decide()
            super().connection_made(self._sniff_transport)
            if buffered:
                super().data_received(buffered)
        super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._decided:  # no websockets handler was started: nothing else to clean up
            self._decide()
            return
        super().connection_lost(exc)

    def drop(self) -> None:
        """Drop a connection still being sniffed (timeout, server close)."""
        if not self._decided:
            self._sniff_transport.abort()

    def _decide(self) -> None:
        self._decided = True
        self._sniffed = bytearray()
        self.front.sniffing.discard(self)
        if self._sniff_timer is not None:
            self._sniff_timer.cancel()
            self._sniff_timer = None
