"""One WebRTC peer connection = one voxpipe session (aiortc).

:class:`RtcPeer` answers the offer (non-trickle ICE: aiortc gathers its host candidates
before the answer is returned; no STUN or TURN server), then runs the session: every decoded
audio frame of the remote track goes to :meth:`Session.on_audio
<pipeline.session.session.Session.on_audio>` (declared as PCM16 48 kHz stereo, which the
session downmixes and resamples to 16 kHz with soxr), the ``events`` data channel carries the
protocol's JSON events both ways, and the reply audio plays on a
:class:`~server.webrtc.tracks.ReplyTrack`. The session ends when the peer connection fails or
closes, the channel closes, the client sends ``session.end``, it is idle, too slow, or it
never connects (:data:`~server.webrtc.types.CONNECT_TIMEOUT_S`).

The same limits as ``/ws`` hold: the server's session cap (the endpoint reserves the slot),
the client's audio and text budgets (:class:`~server.budget.ClientBudget`; a UDP sender
cannot be slowed by not reading, so audio over the budget is dropped, not waited for), the
idle timeout and the slow-client rule. The microphone's Opus packets are decoded on the
event loop as they come out of the jitter buffer (:class:`~server.webrtc.jitter.InlineDecoding`:
cheaper than aiortc's hand-off to a decoder thread and back), the reply's encoded on the codec
pool (:class:`~server.webrtc.tracks.ReplyTrack`); ICE, DTLS, SRTP and SCTP run on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import uuid
from collections.abc import Callable
from typing import Any

from aiortc import RTCPeerConnection, RTCRtpSender, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame

from pipeline import metrics
from pipeline.session import events as ev
from pipeline.session.session import Session

from ..budget import MIN_FRAME_S, ClientBudget, Pace
from ..outbox import SlowClient
from ..protocol import ProtocolError
from ..types import SessionHost
from . import jitter
from .outbox import RtcOutbox
from .tracks import FrameConverter, ReplyTrack
from .types import CONNECT_TIMEOUT_S, EVENTS_LABEL, INPUT_CHANNELS, TRACK_RATE, OfferError, parse_event

logger = logging.getLogger(__name__)

INBOX_MAX = 64
"""Data channel messages waiting to be handled at most; past it they are dropped (a data
channel cannot be slowed by not reading it: SCTP's window is aiortc's)."""
IDLE_CHECK_S = 1.0
"""How often the idle watchdog looks (s)."""
OVER_BUDGET_GRACE_S = 2.0
"""As on ``/ws``: turns are refused while the client is over its budget and this long after."""


class RtcPeer:
    """One peer connection and, once answered, its session.

    Args:
        host: the server (engines, configuration, admission, governor, session count).
        remote: the client's address, for the logs.
        on_closed: called with the peer once it has closed (the endpoint forgets it).

    Attributes:
        pc: the ``RTCPeerConnection``. track: the reply track. out: the session's outbox.
        session: the session (None until :meth:`start`). reason: why it closed.
        counted: the peer holds one of the server's sessions (the endpoint reserved it;
            :meth:`close` gives it back).
    """

    def __init__(self, host: SessionHost, remote: Any, on_closed: Callable[[RtcPeer], None]) -> None:
        self.host, self.remote, self.on_closed = host, remote, on_closed
        self.id = uuid.uuid4().hex[:12]
        s = host.cfg.server
        self.pc = RTCPeerConnection()  # no ICE servers: host candidates only (docs/PROTOCOL.md, "WebRTC")
        self.track = ReplyTrack()
        self.out = RtcOutbox(self.track, maxsize=s.send_queue, timeout_s=s.slow_client_timeout_s,
                             on_slow=lambda: self.close_soon("slow_client"))
        self.session: Session | None = None
        self.budget = ClientBudget(s)
        self.reason = "client"
        self.counted = False
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()  # the latest frame or message from the client
        self._remote_track: MediaStreamTrack | None = None
        self.jitter: jitter.AudioJitterBuffer | None = None  # the audio receiver's (server/webrtc/jitter.py)
        self.converter = FrameConverter()
        self._channel: Any = None
        self._inbox: asyncio.Queue[str | bytes] = asyncio.Queue(maxsize=INBOX_MAX)
        self._tasks: set[asyncio.Task] = set()
        self._closer: asyncio.Task | None = None
        self._connected = asyncio.Event()
        self._channel_open = asyncio.Event()
        self.pc.on("track", self._on_track)
        self.pc.on("datachannel", self._on_channel)
        self.pc.on("connectionstatechange", self._on_state)

    # ---- signalling -----------------------------------------------------------------

    async def answer(self, offer_sdp: str) -> str:
        """The SDP answer to ``offer_sdp`` (checked by :func:`server.webrtc.sdp.check_offer`
        first), with this server's host candidates. Opus is the only audio codec answered;
        video is declined (``inactive``).

        Raises:
            OfferError: 400 when aiortc cannot take the offer; 500 when no answer could be
                made (no candidates could be gathered).
        """
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer_sdp, type="offer"))
            opus = [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.name.lower() == "opus"]
            for t in self.pc.getTransceivers():
                if t.kind == "audio":
                    t.setCodecPreferences(opus)
                    self.jitter = jitter.install(t.receiver) or self.jitter
                else:
                    t.direction = "inactive"
            self.pc.addTrack(self.track)
            answer = await self.pc.createAnswer()
        except Exception as exc:  # noqa: BLE001 - aiortc's ValueError, AssertionError, ... for an offer it cannot take
            raise OfferError(http.HTTPStatus.BAD_REQUEST,
                             f"the SDP offer could not be answered: {type(exc).__name__}: {exc}"[:300]) from None
        try:
            await self.pc.setLocalDescription(answer)
        except Exception as exc:
            logger.exception("WebRTC: no answer could be made")
            raise OfferError(http.HTTPStatus.INTERNAL_SERVER_ERROR,
                             f"no answer could be made: {type(exc).__name__}: {exc}"[:300]) from None
        return self.pc.localDescription.sdp

    # ---- the session ------------------------------------------------------------------

    async def start(self, start: ev.SessionStart) -> None:
        """Open the session (``start``: the client's ``session.start``, its audio fields
        already WebRTC's: :func:`~server.webrtc.types.parse_event`) and the tasks that feed
        it."""
        host = self.host
        metrics.SESSIONS.inc()
        self.session = Session(engines=host.engines, cfg=host.cfg, out=self.out, session_id=self.id,
                               admission=host.admission, governor=host.governor)
        self._spawn(self.out.run(), "writer")
        self._spawn(self._watch_connect(), "connect")
        self._spawn(self._read_events(), "events")
        if host.cfg.server.idle_timeout_s:
            self._spawn(self._watch_idle(), "idle")
        if self._remote_track is not None:
            self._spawn(self._read_audio(self._remote_track), "audio")
        logger.info("session %s opened over WebRTC from %s", self.id, self.remote)
        await self.session.start(start)

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(self._guard(coro), name=f"voxpipe-rtc-{self.id}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guard(self, coro) -> None:
        """Run one of the peer's tasks: a slow client or an unexpected fault closes the peer
        (the latter after a fatal ``internal`` error event, as on ``/ws``)."""
        try:
            await coro
        except SlowClient:
            self.close_soon("slow_client")
        except Exception:
            logger.exception("session %s crashed", self.id)
            if self.session is not None:
                with contextlib.suppress(Exception):
                    await self.session.error("internal", "internal error; session closed", fatal=True)
            self.close_soon("internal")

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind != "audio" or self._remote_track is not None:
            return  # video is declined; a second audio track is not read
        self._remote_track = track
        if self.session is not None:
            self._spawn(self._read_audio(track), "audio")

    def _on_channel(self, channel: Any) -> None:
        if channel.label != EVENTS_LABEL or self._channel is not None:
            logger.info("session %s: data channel %r closed: only one named %r is read", self.id, channel.label,
                        EVENTS_LABEL)
            channel.close()
            return
        self._channel = channel
        channel.on("message", self._on_message)
        channel.on("close", lambda: self.close_soon("client"))
        if channel.readyState == "open":
            self._opened(channel)
        else:
            channel.on("open", lambda: self._opened(channel))

    def _opened(self, channel: Any) -> None:
        self.out.attach(channel)
        self._channel_open.set()

    def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self._connected.set()
        elif state in ("failed", "closed"):
            self.close_soon("client" if state == "closed" else "rtc_failed")

    def _on_message(self, message: str | bytes) -> None:
        self.last = self._loop.time()
        try:
            self._inbox.put_nowait(message)
        except asyncio.QueueFull:
            metrics.TEXT_DROPPED.inc()
            if self.session is not None:
                self._spawn(self.session.error("rate_limited", f"a data channel message dropped: more than "
                                               f"{INBOX_MAX} were waiting"), "warn")

    async def _watch_connect(self) -> None:
        """Close the peer if it is not connected, its ``events`` channel open, in time."""
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await self._connected.wait()
                await self._channel_open.wait()
        except TimeoutError:
            logger.info("session %s: not connected within %.0f s (ICE %s, data channel %s): closing", self.id,
                        CONNECT_TIMEOUT_S, self.pc.iceConnectionState,
                        "none" if self._channel is None else self._channel.readyState)
            self.close_soon("rtc_failed")

    async def _watch_idle(self) -> None:
        """``error`` ``idle_timeout`` (fatal) and close once nothing came from the client for
        ``idle_timeout_s`` while no reply was in progress (the period counts from a reply's
        end, as on ``/ws``)."""
        assert self.session is not None
        idle_s = self.host.cfg.server.idle_timeout_s
        while True:
            await asyncio.sleep(min(IDLE_CHECK_S, idle_s))
            now = self._loop.time()
            if self.session.turn_state.busy:
                self.last = now
            elif now - self.last >= idle_s:
                logger.info("session %s idle for %.0f s: closing", self.id, idle_s)
                await self.session.error("idle_timeout", f"nothing from the client for {idle_s:g} s; session "
                                         "closed", fatal=True)
                self.close_soon("idle")
                return

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        """Every decoded frame of the remote track → the session, within the client's audio
        budget (frames over it are dropped)."""
        session = self.session
        assert session is not None
        convert = self.converter
        read_stall_s = 0.0  # a UDP sender is not slowed by waiting: over the budget, the frame goes
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            self.last = self._loop.time()
            if not isinstance(frame, AudioFrame):
                continue
            data = convert(frame)
            if not data:
                continue
            seconds = len(data) / (2 * INPUT_CHANNELS * TRACK_RATE)
            pace = self.budget.audio_seconds(max(MIN_FRAME_S, seconds), read_stall_s)
            if pace.dropped:
                await self._over_budget(pace, "audio", seconds)
                continue
            await session.on_audio(data)

    async def _read_events(self) -> None:
        """The data channel's messages → the session's client events, within the client's
        text budget."""
        session = self.session
        assert session is not None
        stall_s = self.host.cfg.server.read_stall_s
        while True:
            message = await self._inbox.get()
            if isinstance(message, bytes):
                await session.error("bad_event", "a binary message on the events channel: the audio goes on the "
                                    "audio track, events are JSON text")
                continue
            pace = self.budget.text_frame(len(message), stall_s)
            if pace.wait_s > 0 or pace.dropped:
                await self._over_budget(pace, "text", 1)
                if pace.dropped:
                    continue
            if await self._dispatch(session, message):
                self.close_soon("session_end")
                return

    async def _over_budget(self, pace: Pace, kind: str, dropped: float) -> None:
        """Book a throttled or dropped frame as ``/ws`` does (metrics, refused turns, one
        ``rate_limited`` now and then), then wait out ``pace.wait_s``."""
        assert self.session is not None
        metrics.THROTTLED_SECONDS.labels(kind).inc(pace.wait_s)
        self.session.gate.over_budget(pace.wait_s + OVER_BUDGET_GRACE_S)
        if pace.dropped:
            (metrics.AUDIO_DROPPED if kind == "audio" else metrics.TEXT_DROPPED).inc(dropped)
        if pace.warn:
            s = self.host.cfg.server
            limit = (f"audio faster than {s.audio_rate_x:g}x real time (after a {s.audio_burst_s:g} s burst)"
                     if kind == "audio" else f"more than {s.text_rate:g} events/s (after {s.text_burst:g})")
            what = ("frames over the budget are dropped" if kind == "audio" and pace.dropped
                    else "an event dropped" if pace.dropped else "events are read at that rate from now on")
            await self.session.error("rate_limited", f"{limit}: {what}")
        if pace.wait_s > 0:
            await asyncio.sleep(pace.wait_s)

    async def _dispatch(self, session: Session, text: str) -> bool:
        """Handle one client event; True for ``session.end``."""
        try:
            event = parse_event(text)
        except ProtocolError as exc:
            await session.error(exc.code, str(exc))
            return False
        if isinstance(event, ev.SessionStart):
            await session.start(event)
        elif isinstance(event, ev.InputEnd):
            await session.end_input()
        elif isinstance(event, ev.TextInput):
            await session.text_input(event.text)
        elif isinstance(event, ev.ToolResultIn):
            await session.tool_result(event.call_id, event.output)
        elif isinstance(event, ev.ResponseCancel):
            await session.cancel_response()
        elif isinstance(event, ev.SessionEnd):
            return True
        return False

    # ---- the end ---------------------------------------------------------------------

    def close_soon(self, reason: str) -> None:
        """Start closing the peer (:meth:`close`) in a task of its own, unless it is closing
        already (from a callback, or from one of its own tasks, which closing cancels)."""
        if self._closer is None:
            self.reason = reason
            self._closer = asyncio.create_task(self._close(reason), name=f"voxpipe-rtc-{self.id}-close")

    async def close(self, reason: str = "server") -> None:
        """End the session (its reply stopped, its tasks ended; queued events flushed for up
        to 2 s), then the peer connection; idempotent (the first ``reason``, the metrics
        label, stands)."""
        self.close_soon(reason)
        assert self._closer is not None
        await asyncio.shield(self._closer)

    async def _close(self, reason: str) -> None:
        for task in list(self._tasks):
            if not task.get_name().endswith("-writer"):
                task.cancel()
        if self.session is not None:
            await self.session.close()
        self.out.close()
        writer = [t for t in self._tasks if t.get_name().endswith("-writer")]
        if writer:
            _, late = await asyncio.wait(writer, timeout=2.0)
            for t in late:
                t.cancel()
        self.track.stop()
        try:
            await self.pc.close()
        except Exception:  # closing a half-made connection
            logger.debug("session %s: closing the peer connection failed", self.id, exc_info=True)
        if self.counted:
            self.counted = False
            self.host.sessions -= 1
        if self.session is not None:
            metrics.SESSIONS.dec()
            metrics.SESSIONS_CLOSED.labels(reason).inc()
            j, c = self.jitter, self.converter
            logger.info("session %s closed (%s); WebRTC: %d audio frames in, %.2f s of gaps filled (%s), %d reply "
                        "frames out (%d with audio), %d B of events sent", self.id, reason, c.frames, c.concealed_s,
                        "no jitter buffer of ours" if j is None else
                        f"{j.skipped} packets skipped, {j.late} late, {j.duplicates} twice",
                        self.track.frames, self.track.audio_frames, self.out.sent_bytes)
        self.on_closed(self)
