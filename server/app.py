"""The WebSocket server: ``/ws`` sessions, the web demo, ``/healthz`` and ``/metrics``."""

from __future__ import annotations

import asyncio
import http
import logging
import mimetypes
import uuid
from pathlib import Path

from websockets.asyncio.server import ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.serving.admission import Admission
from pipeline.serving.faults import FaultInjector, parse_rules
from pipeline.serving.governor import Governor
from pipeline.serving.loop_lag import LoopLag
from pipeline.session.events import InputEnd, ResponseCancel, SessionEnd, SessionStart, TextInput
from pipeline.session.session import Session

from .outbox import SlowClient, WsOutbox
from .protocol import ProtocolError, parse_client_event

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
CLOSE_TRY_AGAIN_LATER = 1013
"""WebSocket close code for a connection refused by the session cap (RFC 6455 registry)."""
CLOSE_INTERNAL_ERROR = 1011
"""WebSocket close code after a session failed on an internal error (RFC 6455 §7.4.1)."""
AUTO_SESSIONS_PER_SLOT = 8
"""``--max-sessions 0`` (auto): this many open sessions per LLM batch slot (64 by default).
Sessions mostly listen; admission gates their turns, the cap bounds what idle sessions hold
(buffers, VAD state, an outbox each)."""


class VoxpipeServer:
    """Serves sessions over WebSocket with shared engines.

    Args:
        engines: loaded and started model stages.
        cfg: configuration (``cfg.server`` for limits).
    """

    def __init__(self, engines: Engines, cfg: VoxpipeConfig) -> None:
        self.engines, self.cfg = engines, cfg
        self.ready = False
        self.admission = Admission(cfg.admission)  # one policy, one set of service times, for every session
        # the service level: OOM ladders, circuit breakers, SLO adaptation, injected faults
        self.governor = Governor(cfg, fallback=engines.fallback_llm is not None,
                                 faults=FaultInjector(parse_rules(cfg.degrade.faults)))
        self.governor.attach({"asr": engines.asr, "llm": engines.llm, "tts": engines.tts})
        self._governor_task: asyncio.Task | None = None
        self.loop_lag = LoopLag(on_sample=self.admission.note_loop_lag)
        self._lag_task: asyncio.Task | None = None
        self.sessions = 0
        self.max_sessions = cfg.server.max_sessions or AUTO_SESSIONS_PER_SLOT * cfg.llm_batch.max_batch_size

    async def serve(self, host: str | None = None, port: int | None = None):
        """Start listening; returns the websockets ``Server`` (use as async context)."""
        s = self.cfg.server
        if self._lag_task is None:
            self._lag_task = asyncio.create_task(self.loop_lag.run(), name="voxpipe-loop-lag")
        if self._governor_task is None:
            self._governor_task = asyncio.create_task(self.governor.run(), name="voxpipe-governor")
        return await serve(
            self.handle,
            host or s.host,
            s.port if port is None else port,
            process_request=self.process_request,
            max_size=s.max_message_bytes,
            max_queue=16,
            write_limit=256 * 1024,
            ping_interval=20,
            ping_timeout=20,
            # no permessage-deflate: PCM barely compresses, and deflating every audio frame
            # of every session costs the event loop (and the client) CPU for nothing
            compression=None,
        )

    # ---- HTTP --------------------------------------------------------------------

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/ws":
            if self.sessions >= self.max_sessions:  # cheap early refusal, before the upgrade
                metrics.ADMISSIONS.labels("refused", "sessions").inc()
                resp = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                          f"server full: {self.max_sessions} sessions (--max-sessions)\n")
                resp.headers["Retry-After"] = "5"
                return resp
            return None
        if path == "/healthz":
            status = http.HTTPStatus.OK if self.ready else http.HTTPStatus.SERVICE_UNAVAILABLE
            return connection.respond(status, "ready\n" if self.ready else "warming up\n")
        if path == "/metrics":
            return _response(200, metrics.render(self.engines), "text/plain; version=0.0.4")
        name = "index.html" if path == "/" else path.lstrip("/")
        try:
            file = (WEB_DIR / name).resolve()
            found = file.is_file() and WEB_DIR in file.parents
        except (OSError, ValueError):  # a name too long, or with a NUL: no such file
            found = False
        if found:
            ctype = mimetypes.guess_type(file.name)[0] or "application/octet-stream"
            if file.suffix == ".js":
                ctype = "text/javascript"
            return _response(200, file.read_bytes(), ctype)
        return connection.respond(http.HTTPStatus.NOT_FOUND, "not found\n")

    # ---- WebSocket ---------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        """One connection = one session; everything it starts ends with it."""
        if self.sessions >= self.max_sessions:  # checked and counted with no await between: atomic
            metrics.ADMISSIONS.labels("refused", "sessions").inc()
            await ws.close(CLOSE_TRY_AGAIN_LATER, f"server full: {self.max_sessions} sessions")
            return
        sid = uuid.uuid4().hex[:12]
        close_code = 1000  # normal closure; 1011 after an internal error
        s = self.cfg.server
        out = WsOutbox(ws, maxsize=s.send_queue, timeout_s=s.slow_client_timeout_s)
        writer = asyncio.create_task(out.run())
        session = Session(engines=self.engines, cfg=self.cfg, out=out, session_id=sid, admission=self.admission,
                          governor=self.governor)
        self.sessions += 1  # no await since the check above: a burst never admits cap + 1
        metrics.SESSIONS.inc()
        logger.info("session %s opened from %s", sid, ws.remote_address)
        try:
            if not self.ready:
                await session.error("not_ready", "server is warming up; try again shortly", fatal=True)
                return
            async for message in ws:
                if isinstance(message, bytes):
                    await session.on_audio(message)
                elif await self._dispatch(session, message) is SessionEnd:
                    break
        except (ConnectionClosed, SlowClient):
            pass
        except Exception:
            logger.exception("session %s crashed", sid)
            close_code = CLOSE_INTERNAL_ERROR
            try:
                await session.error("internal", "internal error; session closed", fatal=True)
            except Exception:  # noqa: BLE001
                pass
        finally:
            await session.close()
            out.close()
            try:
                await asyncio.wait_for(writer, timeout=2.0)
            except (TimeoutError, Exception):  # noqa: BLE001
                writer.cancel()
            await ws.close(close_code, "internal error" if close_code == CLOSE_INTERNAL_ERROR else "")
            self.sessions -= 1
            metrics.SESSIONS.dec()
            logger.info("session %s closed", sid)

    async def _dispatch(self, session: Session, text: str):
        try:
            ev = parse_client_event(text)
        except ProtocolError as exc:
            await session.error(exc.code, str(exc))
            return None
        if isinstance(ev, SessionStart):
            await session.start(ev)
        elif isinstance(ev, InputEnd):
            await session.end_input()
        elif isinstance(ev, TextInput):
            await session.text_input(ev.text)
        elif isinstance(ev, ResponseCancel):
            await session.cancel_response()
        elif isinstance(ev, SessionEnd):
            return SessionEnd
        return None


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)
