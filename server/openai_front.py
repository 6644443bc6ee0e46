"""The ASGI entry of voxpipe's OpenAI-compatible HTTP API: :func:`openai_app` routes
``/v1/models``, ``/v1/chat/completions`` and ``/v1/voices`` to :class:`~server.openai_api.OpenAiApi` behind
:class:`ApiFront`, which checks the edge (``Host``, ``Origin``, the bearer token), counts
requests by status, and answers what is not for the API on a kept-alive connection with the
server's plain answers. :mod:`server.http_front` hands it the requests under ``/v1/`` and
every other method than GET: ``POST /webrtc/offer`` goes, past the same edge checks, to the
WebRTC endpoint (:mod:`server.webrtc.endpoint`)."""

from __future__ import annotations

import http
import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from websockets.datastructures import Headers

from pipeline import metrics

from .http_front import MAX_HEADER_BYTES
from .openai_api import STATUS_TYPE, OpenAiApi, error_response
from .openai_schema import ApiError
from .plain_http import PlainConnection, plain_answer
from .types import ApiHost
from .webrtc.endpoint import RtcEndpoint
from .webrtc.types import OFFER_PATH

logger = logging.getLogger(__name__)


class ApiFront:
    """The ASGI entry: the edge checks for ``/v1/...`` (OpenAI-style errors), metrics by
    status, and — for a later request on a kept-alive API connection that is not for the
    API — the server's plain answers (:meth:`~server.types.HttpHost.process_request`)."""

    def __init__(self, app: ASGIApp, server: ApiHost, webrtc: RtcEndpoint | None = None) -> None:
        self.app, self.server, self.webrtc = app, server, webrtc

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        headers = Headers([(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]])
        query = scope["query_string"].decode("latin-1")
        if path == OFFER_PATH and self.webrtc is not None:
            await self._webrtc(scope, receive, send, path, query, headers)
            return
        if not path.startswith("/v1/") or path.rstrip("/") == "/v1/realtime":  # websockets' paths
            await self._plain(scope, send, path, query)
            return
        endpoint = {"/v1/chat/completions": "chat_completions", "/v1/models": "models",
                    "/v1/voices": "voices"}.get(
            path, "model" if path.startswith("/v1/models/") else "other")
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEADER_BYTES:
                err = ApiError(431, f"request headers over {MAX_HEADER_BYTES} bytes", code="headers_too_large")
                await error_response(err)(scope, receive, counted)
                return
            refusal = self.server.edge.check(path, query, headers)
            if refusal is not None:
                metrics.EDGE_REFUSALS.labels(refusal.reason).inc()
                logger.info("refused %s from %s: %s", path[:100], scope.get("client"), refusal.message)
                extra = {"WWW-Authenticate": 'Bearer realm="voxpipe"'} if refusal.status == 401 else None
                err = ApiError(refusal.status, refusal.message, code=refusal.reason, headers=extra,
                               type=STATUS_TYPE.get(refusal.status, "invalid_request_error"))
                await error_response(err)(scope, receive, counted)
                return
            await self.app(scope, receive, counted)
        finally:
            metrics.HTTP_API_REQUESTS.labels(endpoint, str(status)).inc()

    async def _webrtc(self, scope: Scope, receive: Receive, send: Send, path: str, query: str,
                      headers: Headers) -> None:
        """``POST /webrtc/offer``: the edge's checks with ``/ws``'s plain-text refusals, then
        the WebRTC endpoint (server/webrtc/endpoint.py)."""
        assert self.webrtc is not None
        if sum(len(k) + len(v) + 4 for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            resp: Response = PlainTextResponse(f"request headers over {MAX_HEADER_BYTES} bytes\n", 431)
        elif (refusal := self.server.edge.check(path, query, headers)) is not None:
            metrics.EDGE_REFUSALS.labels(refusal.reason).inc()
            logger.info("refused %s from %s: %s", path, scope.get("client"), refusal.message)
            extra = {"WWW-Authenticate": 'Bearer realm="voxpipe"'} if refusal.status == 401 else None
            resp = PlainTextResponse(refusal.message + "\n", refusal.status, headers=extra)
        elif scope["method"] != "POST":
            resp = PlainTextResponse("use POST with the SDP offer (JSON)\n", 405, headers={"Allow": "POST"})
        else:
            resp = await self.webrtc.offer(Request(scope, receive))
        await resp(scope, receive, send)

    async def _plain(self, scope: Scope, send: Send, path: str, query: str) -> None:
        client = scope.get("client")
        if scope["method"] != "GET":
            resp = PlainConnection(client).respond(http.HTTPStatus.METHOD_NOT_ALLOWED, "method not allowed\n")
        else:
            resp = plain_answer(self.server, path, query, scope["headers"], client) or PlainConnection(
                client).respond(http.HTTPStatus.BAD_REQUEST, "WebSocket upgrade on a new connection only\n")
        body = bytes(resp.body or b"")
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1"))
               for k, v in resp.headers.raw_items() if k.lower() != "content-length"]
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": [*raw, (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def openai_app(server: ApiHost, webrtc: RtcEndpoint | None = None) -> ASGIApp:
    """The ASGI app of the HTTP API over ``server``, and of ``POST /webrtc/offer`` when
    ``webrtc`` is given."""
    api = OpenAiApi(server)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(ApiError(exc.status_code, str(exc.detail),
                                        type=STATUS_TYPE.get(exc.status_code, "invalid_request_error"),
                                        code="not_found" if exc.status_code == 404 else None))

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return error_response(exc)

    app = Starlette(routes=[
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", api.model_info, methods=["GET"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/voices", api.voices, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, ApiError: api_error})
    return ApiFront(app, server, webrtc)
