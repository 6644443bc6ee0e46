"""The front end as Ray Serve's ingress: one ``serve run`` starts the stages and the sessions.

``serve run deploy/ray-serve-ingress.yaml`` (or ``serve run server.ingress:app``) deploys the
``asr``, ``llm`` and ``tts`` stages (:mod:`pipeline.remote.replicas`) and a ``frontend``
whose FastAPI app, behind Serve's HTTP proxy, serves ``/ws``, ``/healthz``, ``/metrics`` and
the web demo with the same :class:`~server.app.VoxpipeServer` as ``voxpipe serve`` (session
loop, edge checks, session cap, budgets) over a Starlette ``WebSocket`` given the few methods
that loop uses (:class:`StarletteSocket`); local VAD, the stages through their handles.

A live WebSocket is one ongoing request of the frontend for its whole life (measured: with
``max_ongoing_requests=2`` a third WebSocket's handshake, and ``/healthz``, wait in the proxy
until one closes), so ``max_ongoing_requests`` is the session cap + :data:`HTTP_HEADROOM`:
voxpipe's own refusal speaks before Serve queues, and ``/healthz`` stays reachable.
"""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any, cast

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import Response as StarletteResponse
from ray import serve
from ray.serve import Application, Deployment
from ray.serve.handle import DeploymentHandle
from starlette.websockets import WebSocketDisconnect
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed, ConnectionClosedError, ConnectionClosedOK
from websockets.frames import Close
from websockets.http11 import Response as WsResponse

from pipeline.config import SchedulerConfig, VoxpipeConfig
from pipeline.engines import warm_up
from pipeline.remote.app import bind_stages
from pipeline.remote.connect import engines_from_handles
from pipeline.remote.settings import FRONTEND_SECTIONS, config_from_user, deployment_options, frontend_user_config
from pipeline.remote.types import FRONTEND_NAME

from .app import AUTO_SESSIONS_PER_SLOT, VoxpipeServer
from .plain_http import plain_answer

logger = logging.getLogger(__name__)

HTTP_HEADROOM = 16
"""``max_ongoing_requests`` beyond the session cap: page loads, ``/healthz``, ``/metrics``
and refused handshakes while every session is open."""
DEFAULT_MAX_ONGOING = AUTO_SESSIONS_PER_SLOT * SchedulerConfig().max_batch_size + HTTP_HEADROOM
"""The frontend's ``max_ongoing_requests`` per replica with the default session cap (64 + 16)."""
STAGE_WAIT_S = 600.0
"""How long a frontend replica waits for the stages' first answer (their models load)."""

api = FastAPI(title="voxpipe", docs_url=None, redoc_url=None, openapi_url=None)


class StarletteSocket:
    """A Starlette ``WebSocket`` with what :meth:`VoxpipeServer.handle` and its outbox use of
    a websockets ``ServerConnection`` (``recv``, ``send``, ``ping``, ``close``,
    ``remote_address``; closed: websockets' ``ConnectionClosed``; a frame over ``max_size``
    closes with 1009, as websockets does; Serve's proxy accepts up to uvicorn's 16 MiB)."""

    def __init__(self, ws: WebSocket, max_size: int) -> None:
        self.ws, self.max_size = ws, max_size
        self.remote_address = (ws.client.host, ws.client.port) if ws.client else None
        self.received: Close | None = None  # the client's close
        self.sent: Close | None = None  # ours

    def _closed(self) -> ConnectionClosed:
        ok = all(c is None or c.code in (1000, 1001) for c in (self.received, self.sent))
        return (ConnectionClosedOK if ok else ConnectionClosedError)(self.received, self.sent)

    async def recv(self) -> str | bytes:
        if self.received is not None:
            raise self._closed()
        try:
            msg = await self.ws.receive()
        except (WebSocketDisconnect, RuntimeError) as exc:  # Starlette's state errors
            self.received = Close(getattr(exc, "code", 1006), "")
            raise self._closed() from exc
        if msg["type"] == "websocket.disconnect":
            self.received = Close(int(msg.get("code") or 1005), str(msg.get("reason") or ""))
            raise self._closed()
        data: str | bytes = msg["bytes"] if msg.get("bytes") is not None else msg.get("text") or ""
        if len(data) > self.max_size:
            await self.close(1009, "message too big")
            raise self._closed()
        return data

    async def send(self, data: str | bytes) -> None:
        if self.received is not None or self.sent is not None:
            raise self._closed()
        try:
            if isinstance(data, bytes):
                await self.ws.send_bytes(data)
            else:
                await self.ws.send_text(data)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            self.received = self.received or Close(1006, "")
            raise self._closed() from exc

    async def ping(self) -> asyncio.Future[float]:
        """A pong at once: ASGI has no ping; the proxy's uvicorn pings the client itself."""
        if self.received is not None or self.sent is not None:
            raise self._closed()
        pong: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        pong.set_result(0.0)
        return pong

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self.sent is not None or self.received is not None:
            return
        self.sent = Close(code, reason)
        try:
            await self.ws.close(code, reason)
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass


def _starlette(resp: WsResponse) -> StarletteResponse:
    return StarletteResponse(bytes(resp.body or b""), resp.status_code, headers=dict(resp.headers.raw_items()))


class Frontend:
    """One frontend replica: a :class:`VoxpipeServer` over the stage deployments.

    Args:
        asr, llm, tts: the stages' handles (bound deployments), or None with ``stages_app``.
        stages_app: the name of an application already deployed that holds the stages.
        llm_options: the ``llm`` deployment's options (its capacity, for the LLM client).
    """

    def __init__(self, asr: DeploymentHandle | None = None, llm: DeploymentHandle | None = None,
                 tts: DeploymentHandle | None = None, *, stages_app: str | None = None,
                 llm_options: dict[str, Any] | None = None) -> None:
        if stages_app is not None:
            asr, llm, tts = (serve.get_deployment_handle(s, app_name=stages_app) for s in ("asr", "llm", "tts"))
        if asr is None or llm is None or tts is None:
            raise ValueError("Frontend: give the three stage handles or stages_app")
        self._handles = (asr, llm, tts)
        self._llm_options = llm_options
        self._settings: dict[str, Any] | None = None
        self.server: VoxpipeServer | None = None

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config`` (a partial VoxpipeConfig: ``server``, ``turn``, ``llm``, ...):
        the first builds the server, waits for the stages and warms them up; a later, changed
        one is only logged (redeploy). Raises ValueError (bad config), Ray's errors, TimeoutError."""
        if self.server is not None:
            if user_config != self._settings:
                logger.warning("frontend: a changed user_config applies to new replicas only (redeploy)")
            return
        cfg = config_from_user(user_config, FRONTEND_SECTIONS)
        engines = await asyncio.to_thread(engines_from_handles, cfg, *self._handles,
                                          llm_options=self._llm_options, timeout_s=STAGE_WAIT_S)
        server = VoxpipeServer(engines, cfg)
        server.start_tasks()
        await warm_up(engines)
        server.governor.faults.arm()
        server.ready = True
        self.server, self._settings = server, user_config
        logger.info("frontend ready: %d sessions at most", server.max_sessions)

    def _server(self) -> VoxpipeServer:
        if self.server is None or not self.server.ready:
            raise RuntimeError("frontend not ready (no user_config applied yet)")
        return self.server

    async def check_health(self) -> None:
        """Serve's health check: the server is built and ready."""
        self._server()

    def __del__(self) -> None:  # Serve's graceful shutdown: stop the stats pollers
        if self.server is not None:
            self.server.engines.stop()

    @api.websocket("/ws")
    async def ws(self, websocket: WebSocket) -> None:
        """One session: the edge checks and the session cap first (a refusal is the same
        HTTP response as the websockets server's: Serve's proxy passes ASGI denial
        responses), then :meth:`VoxpipeServer.handle`."""
        server = self._server()
        refusal = self._check(websocket, "/ws")
        if refusal is not None:
            if "websocket.http.response" in websocket.scope.get("extensions", {}):
                await websocket.send_denial_response(_starlette(refusal))
                return
            if refusal.status_code != http.HTTPStatus.SERVICE_UNAVAILABLE:
                await websocket.close(code=1008)  # before the upgrade: HTTP 403
                return
        await websocket.accept()  # (a full server without denial responses: handle() closes with 1013)
        await server.handle(cast(ServerConnection, StarletteSocket(websocket, server.cfg.server.max_message_bytes)))

    @api.get("/{path:path}")
    async def http_get(self, path: str, request: Request) -> StarletteResponse:
        """Every GET: ``/healthz``, ``/metrics``, the web demo (the websockets server's
        :meth:`~VoxpipeServer.process_request`, edge checks included)."""
        resp = self._check(request, "/" + path)
        if resp is None:  # /ws without the upgrade
            return StarletteResponse("WebSocket only\n", http.HTTPStatus.BAD_REQUEST)
        return _starlette(resp)

    def _check(self, conn: WebSocket | Request, path: str) -> WsResponse | None:
        remote = (conn.client.host, conn.client.port) if conn.client else None  # the websockets server's checks
        return plain_answer(self._server(), path, conn.url.query, conn.headers.raw, remote)


FRONTEND: Deployment = serve.deployment(
    name=FRONTEND_NAME, user_config={}, max_ongoing_requests=DEFAULT_MAX_ONGOING, max_queued_requests=HTTP_HEADROOM,
    ray_actor_options={"num_cpus": 0})(serve.ingress(api)(Frontend))
"""The frontend deployment (``num_cpus`` 0: it fits beside the stages on a 2-CPU node)."""


def build_ingress_app(cfg: VoxpipeConfig | None = None, overrides: dict[str, dict[str, Any]] | None = None, *,
                      stages_app: str | None = None) -> Application:
    """The frontend bound to the stage deployments built from ``cfg`` and ``overrides``
    (as :func:`pipeline.remote.app.build_app`; ``overrides["frontend"]``: the frontend's
    Serve options), or to the stages of the application ``stages_app`` already deployed.
    Its ``max_ongoing_requests`` defaults to the session cap + :data:`HTTP_HEADROOM`."""
    cfg = cfg or VoxpipeConfig()
    overrides = overrides or {}
    sessions = cfg.server.max_sessions or AUTO_SESSIONS_PER_SLOT * cfg.llm_batch.max_batch_size
    opts: dict[str, Any] = {"max_ongoing_requests": sessions + HTTP_HEADROOM, "user_config": frontend_user_config(cfg),
                            **overrides.get(FRONTEND_NAME, {})}
    llm_opts = deployment_options("llm", cfg, overrides.get("llm"))
    llm_options = {k: llm_opts[k] for k in ("max_ongoing_requests", "max_queued_requests") if k in llm_opts}
    frontend = FRONTEND.options(**opts)
    if stages_app is not None:
        return frontend.bind(stages_app=stages_app, llm_options=llm_options)
    return frontend.bind(*bind_stages(cfg, overrides), llm_options=llm_options)


app = build_ingress_app()
"""Everything with voxpipe's defaults: the import path of ``deploy/ray-serve-ingress.yaml``."""
