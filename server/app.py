"""The WebSocket server: ``/ws`` sessions, the web demo, ``/healthz`` and ``/metrics``
(and, on the same port, the HTTP API and ``POST /webrtc/offer``: server/http_front.py)."""

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
from websockets.protocol import State

from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.engines import Engines
from pipeline.fault_rules import parse_rules
from pipeline.serving.admission import Admission
from pipeline.serving.faults import FaultInjector
from pipeline.serving.governor import Governor
from pipeline.serving.loop_lag import LoopLag
from pipeline.session.events import InputEnd, ResponseCancel, SessionEnd, SessionStart, TextInput, ToolResultIn
from pipeline.session.session import Session

from .budget import MIN_FRAME_S, ClientBudget, Pace
from .edge import EdgeGuard
from .http_front import HttpFront
from .idle import FrameReader, IdleClient
from .keepalive import keepalive
from .openai_front import openai_app
from .outbox import SlowClient, WsOutbox
from .protocol import ProtocolError, parse_client_event
from .realtime.outbox import RealtimeOutbox
from .realtime.types import Settings as RealtimeSettings
from .realtime.wire import RealtimeWire, dialect_from_headers
from .twilio.outbox import TwilioOutbox
from .twilio.types import TWILIO_PATH
from .twilio.wire import TwilioWire
from .webrtc.endpoint import RtcEndpoint
from .webrtc.types import OFFER_PATH

logger = logging.getLogger(__name__)

WEB_DIR = Path(__file__).resolve().parent.parent / "web"
REALTIME_PATH = "/v1/realtime"
"""The OpenAI Realtime API subset (server/realtime/, docs/REALTIME.md): sessions as ``/ws``."""
CLOSE_TRY_AGAIN_LATER = 1013
"""WebSocket close code for a connection refused by the session cap (RFC 6455 registry)."""
CLOSE_INTERNAL_ERROR = 1011
"""WebSocket close code after a session failed on an internal error (RFC 6455 §7.4.1)."""
CLOSE_NORMAL = 1000
"""WebSocket close code of a normal end: ``session.end``, or an idle session closed."""
CLOSE_POLICY = 1008
"""WebSocket close code of a connection refused after the upgrade (a Twilio stream whose
``token`` parameter is wrong: RFC 6455 §7.4.1, policy violation)."""
OVER_BUDGET_GRACE_S = 2.0
"""A client's turns are refused while it is throttled and this long after (s): a turn that
ends right after a throttled stretch was sent beyond its budget too."""
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
        self.edge = EdgeGuard(cfg.server)
        self.sessions = 0
        self.max_sessions = cfg.server.max_sessions or AUTO_SESSIONS_PER_SLOT * cfg.llm_batch.max_batch_size
        self.http_front: HttpFront | None = None  # the HTTP API's connections, once serving
        self.webrtc = RtcEndpoint(self)  # POST /webrtc/offer: sessions over WebRTC (aiortc, imported on first use)

    async def serve(self, host: str | None = None, port: int | None = None):
        """Start listening; returns the websockets ``Server`` (use as async context). The
        same port serves the OpenAI-compatible HTTP API under ``/v1/`` (server/http_front.py)."""
        s = self.cfg.server
        self.start_tasks()
        front = self.http_front = HttpFront(openai_app(self, self.webrtc), max_connections=self.max_sessions)
        server = await serve(
            self.handle,
            host or s.host,
            s.port if port is None else port,
            process_request=self.process_request,
            max_size=s.max_message_bytes,
            max_queue=s.receive_queue,
            write_limit=256 * 1024,
            ping_interval=None,  # our own keepalive (server/keepalive.py): a throttled client survives it
            ping_timeout=None,
            # no permessage-deflate: PCM barely compresses, and deflating every audio frame
            # of every session costs the event loop (and the client) CPU for nothing
            compression=None,
            create_connection=front.connection_class(),
        )
        front.attach(server)  # closing the server closes the HTTP API's connections too
        self.webrtc.attach(server)  # ... and the WebRTC peers, with their sessions
        return server

    def start_tasks(self) -> None:
        """Start the background tasks (loop-lag probe, governor) on the running loop
        (idempotent); :meth:`serve` does, and so does a Serve ingress (server/ingress.py)."""
        if self._lag_task is None:
            self._lag_task = asyncio.create_task(self.loop_lag.run(), name="voxpipe-loop-lag")
        if self._governor_task is None:
            self._governor_task = asyncio.create_task(self.governor.run(), name="voxpipe-governor")

    async def stop_tasks(self) -> None:
        """Stop the background tasks :meth:`serve` started (loop-lag probe, governor)."""
        tasks = [t for t in (self._lag_task, self._governor_task) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lag_task = self._governor_task = None

    # ---- HTTP --------------------------------------------------------------------

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path, _, query = request.path.partition("?")
        refusal = self.edge.check(path, query, request.headers)
        if refusal is not None:
            metrics.EDGE_REFUSALS.labels(refusal.reason).inc()
            logger.info("refused %s from %s: %s", path[:100], connection.remote_address, refusal.message)
            resp = connection.respond(refusal.status, refusal.message + "\n")
            if refusal.status == http.HTTPStatus.UNAUTHORIZED:
                resp.headers["WWW-Authenticate"] = 'Bearer realm="voxpipe"'
            return resp
        if path in ("/ws", REALTIME_PATH, TWILIO_PATH):
            if self.sessions >= self.max_sessions:  # cheap early refusal, before the upgrade
                metrics.ADMISSIONS.labels("refused", "sessions").inc()
                resp = connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE,
                                          f"server full: {self.max_sessions} sessions (--max-sessions)\n")
                resp.headers["Retry-After"] = "5"
                return resp
            return None
        if path == OFFER_PATH:  # a GET (a POST goes to the HTTP front: server/openai_front.py)
            resp = connection.respond(http.HTTPStatus.METHOD_NOT_ALLOWED, "use POST with the SDP offer (JSON)\n")
            resp.headers["Allow"] = "POST"
            return resp
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
        close_code, reason = CLOSE_NORMAL, "client"  # 1011 after an internal error
        s = self.cfg.server
        request = getattr(ws, "request", None)  # None: a Serve ingress adapter (always /ws)
        path = request.path.partition("?")[0] if request is not None else "/ws"
        realtime, twilio = path == REALTIME_PATH, path == TWILIO_PATH
        out = (RealtimeOutbox(ws, RealtimeSettings(dialect=dialect_from_headers(request.headers if request else {})),
                              maxsize=s.send_queue, timeout_s=s.slow_client_timeout_s) if realtime
               else TwilioOutbox(ws, maxsize=s.send_queue, timeout_s=s.slow_client_timeout_s) if twilio
               else WsOutbox(ws, maxsize=s.send_queue, timeout_s=s.slow_client_timeout_s))
        writer = asyncio.create_task(out.run())
        session = Session(engines=self.engines, cfg=self.cfg, out=out, session_id=sid, admission=self.admission,
                          governor=self.governor)
        wire = RealtimeWire(out, session, self.cfg) if isinstance(out, RealtimeOutbox) else None
        phone = TwilioWire(out, session, self.cfg) if isinstance(out, TwilioOutbox) else None
        self.sessions += 1  # no await since the check above: a burst never admits cap + 1
        metrics.SESSIONS.inc()
        logger.info("session %s opened from %s", sid, ws.remote_address)
        alive: asyncio.Task | None = None
        idle: asyncio.Task | None = None
        timed_out: asyncio.Event | None = None
        try:
            if not self.ready:
                reason = "not_ready"
                await session.error("not_ready", "server is warming up; try again shortly", fatal=True)
                return
            budget = ClientBudget(s)
            if wire is not None:
                await wire.open()
            reader = FrameReader(ws, s.idle_timeout_s, lambda: session.turn_state.busy)
            session.client_clock = lambda: reader.waited  # a server reading late does not make the client late
            timed_out = asyncio.Event()  # the keepalive closed it: the close reason
            alive = asyncio.create_task(keepalive(ws, lambda: reader.last, s.keepalive_s, s.keepalive_s,
                                                  on_timeout=timed_out.set))
            idle = asyncio.create_task(reader.watch())
            while True:
                message = await reader.recv()
                if getattr(ws, "state", None) is State.CLOSED:  # gone: what it queued is not worth answering
                    break
                if phone is not None:  # /twilio: media paced as audio, other messages as text
                    outcome = await phone.frame(message, lambda pcm: self._audio(session, budget, pcm),
                                                lambda n: self._pace(session, budget.text_frame(n, s.read_stall_s),
                                                                     "text", 1))
                    if outcome is not None:
                        reason = "session_end" if outcome == "stop" else "denied"
                        close_code = CLOSE_NORMAL if outcome == "stop" else CLOSE_POLICY
                        break
                    continue
                if wire is not None:  # /v1/realtime: appended audio paced as audio, other frames as text
                    await wire.frame(message, lambda pcm: self._audio(session, budget, pcm),
                                     lambda n: self._pace(session, budget.text_frame(n, s.read_stall_s), "text", 1))
                    continue
                if isinstance(message, bytes):
                    await self._audio(session, budget, message)
                    continue
                pace = budget.text_frame(len(message), self.cfg.server.read_stall_s)
                if not await self._pace(session, pace, "text", 1):
                    continue
                if await self._dispatch(session, message) is SessionEnd:
                    reason = "session_end"
                    break
        except IdleClient:
            reason = "idle"
            logger.info("session %s idle for %.0f s: closing", sid, s.idle_timeout_s)
            await session.error("idle_timeout", f"no frame from the client for {s.idle_timeout_s:g} s; "
                                "session closed", fatal=True)
        except ConnectionClosed as exc:
            if timed_out is not None and timed_out.is_set():
                reason = "keepalive"
            elif exc.sent is not None and exc.rcvd_then_sent is not True:
                reason = "server"  # this side closed first: the server is shutting down
        except SlowClient:
            reason = "slow_client"
        except Exception:
            logger.exception("session %s crashed", sid)
            close_code, reason = CLOSE_INTERNAL_ERROR, "internal"
            try:
                await session.error("internal", "internal error; session closed", fatal=True)
            except Exception:  # noqa: BLE001
                pass
        finally:
            for task in (alive, idle):
                if task is not None:
                    task.cancel()
            await session.close()
            out.close()
            try:
                await asyncio.wait_for(writer, timeout=2.0)
            except (TimeoutError, Exception):  # noqa: BLE001
                writer.cancel()
            await ws.close(close_code, {"internal": "internal error", "idle": "idle",
                                        "denied": "a valid token is required"}.get(reason, ""))
            self.sessions -= 1
            metrics.SESSIONS.dec()
            metrics.SESSIONS_CLOSED.labels(reason).inc()
            logger.info("session %s closed (%s)", sid, reason)

    async def _audio(self, session: Session, budget: ClientBudget, data: bytes) -> None:
        """An audio frame, handled one second of audio at a time, each after its budget
        allows; what would stall the reader past ``read_stall_s`` is dropped (a 4 MiB frame
        of 8 kHz PCM16 holds 4 minutes). An Opus packet is paced by the audio it holds (its
        TOC byte), so its decoding counts in the same budget."""
        per_s = session.audio_bytes_per_s()
        if per_s is None:
            packet_s = session.frame_seconds(data)
            if packet_s is None:  # no session.start yet: the session reports it, paced as any frame
                pace = budget.text_frame(0, self.cfg.server.read_stall_s)
                kind, dropped = "text", 1.0
            else:  # one Opus packet (at most 120 ms): its audio, and its decoding, paced as audio
                pace = budget.audio_seconds(max(MIN_FRAME_S, packet_s), self.cfg.server.read_stall_s)
                kind, dropped = "audio", packet_s
            if await self._pace(session, pace, kind, dropped):
                await session.on_audio(data)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.server.read_stall_s
        for i in range(0, max(len(data), 1), per_s):
            rest_s = (len(data) - i) / per_s
            pace = budget.audio_seconds(max(MIN_FRAME_S, min(1.0, rest_s)), max(0.0, deadline - loop.time()))
            if not await self._pace(session, pace, "audio", rest_s):
                return
            await session.on_audio(data[i:i + per_s])

    async def _pace(self, session: Session, pace: Pace, kind: str, dropped: float) -> bool:
        """Wait as the client's budget says before handling its frame or piece (see
        server.budget); False: it is dropped (``dropped``: audio seconds or text frames
        lost with it)."""
        if pace.wait_s <= 0.0 and not pace.dropped:
            return True
        metrics.THROTTLED_SECONDS.labels(kind).inc(pace.wait_s)
        session.gate.over_budget(pace.wait_s + OVER_BUDGET_GRACE_S)
        if pace.dropped:
            (metrics.AUDIO_DROPPED if kind == "audio" else metrics.TEXT_DROPPED).inc(dropped)
        if pace.warn:
            s = self.cfg.server
            limit = (f"audio faster than {s.audio_rate_x:g}x real time (after a {s.audio_burst_s:g} s burst)"
                     if kind == "audio" else f"more than {s.text_rate:g} text frames/s (after {s.text_burst:g})")
            if not pace.dropped:
                what = "it is read at that rate from now on"
            elif kind == "audio":
                what = f"{dropped:.1f} s of audio dropped from a frame that held more"
            else:
                what = (f"a text frame dropped (it would have waited over {s.read_stall_s:g} s; a large frame "
                        "counts once per 16 KiB)")
            await session.error("rate_limited", f"{limit}: {what}")
        await asyncio.sleep(pace.wait_s)
        return not pace.dropped

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
        elif isinstance(ev, ToolResultIn):
            await session.tool_result(ev.call_id, ev.output)
        elif isinstance(ev, ResponseCancel):
            await session.cancel_response()
        elif isinstance(ev, SessionEnd):
            return SessionEnd
        return None


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)
