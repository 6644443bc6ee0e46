"""``POST /webrtc/offer``: the signalling request, and the server's peer connections.

The request is JSON ``{"type": "offer", "sdp": "...", "session": {...}}`` (``session``: the
fields of a ``session.start``, optional; its audio fields are WebRTC's whatever it says); the
answer is ``{"type": "answer", "sdp": "..."}`` with the server's host candidates (non-trickle
ICE). The edge's checks (``Host``, ``Origin``, token) were made by the HTTP front
(:class:`server.openai_front.ApiFront`) before :meth:`RtcEndpoint.offer` runs. Refusals are
one plain-text sentence, as ``/ws``'s HTTP refusals:

| status | when |
|---|---|
| 400 | not JSON, not an offer, an SDP offer that is cut or lacks what voxpipe needs, an invalid ``session`` |
| 408, 413 | the body did not come within 10 s, or is over 64 KiB |
| 501 | aiortc is not installed (the sentence says how to install it) |
| 503 | warming up, shutting down, or the session cap (``Retry-After: 5``, shared with ``/ws``) |

aiortc is imported on the first offer, never at start: a server without it serves everything
else as before.
"""

from __future__ import annotations

import asyncio
import http
import importlib.util
import json
import logging
from typing import TYPE_CHECKING

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from websockets.asyncio.server import Server

from pipeline import metrics
from pipeline.session import events as ev

from ..http_front import BODY_TIMEOUT_S, close_along
from ..protocol import ProtocolError, json_kind
from ..types import SessionHost
from .sdp import check_offer
from .types import INSTALL_HINT, MAX_OFFER_BYTES, OfferError, parse_event

if TYPE_CHECKING:
    from .peer import RtcPeer

logger = logging.getLogger(__name__)

SESSIONS_RETRY_S = 5
"""``Retry-After`` of a refusal by the session cap (as ``/ws``'s)."""
CLOSE_GRACE_S = 3.0
"""At server close, how long the peers get to close."""


def aiortc_installed() -> bool:
    """Whether the WebRTC stack (aiortc) can be imported."""
    return importlib.util.find_spec("aiortc") is not None


def parse_offer(body: bytes) -> tuple[str, ev.SessionStart]:
    """The request body → (the offer's SDP, the session's ``session.start``).

    Raises:
        OfferError: 400 with the reason.
    """
    bad = http.HTTPStatus.BAD_REQUEST
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise OfferError(bad, f"the body is not JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise OfferError(bad, f"the body must be a JSON object, got {json_kind(data)}")
    if data.get("type") != "offer":
        raise OfferError(bad, 'the body must be {"type": "offer", "sdp": "...", "session": {...}}: '
                              f"type is {str(data.get('type'))[:40]!r}")
    sdp = data.get("sdp")
    if not isinstance(sdp, str) or not sdp.strip():
        raise OfferError(bad, "sdp must be the offer's SDP text (a non-empty string)")
    session = data.get("session", {})
    if session is None:
        session = {}
    if not isinstance(session, dict):
        raise OfferError(bad, f"session must be an object of session.start fields, got {json_kind(session)}")
    try:
        start = parse_event(json.dumps({**session, "type": "session.start"}))
    except ProtocolError as exc:
        raise OfferError(bad, f"session: {str(exc).removeprefix('invalid session.start: ')}") from None
    assert isinstance(start, ev.SessionStart)
    return sdp, start


class RtcEndpoint:
    """The WebRTC edge of one server: answers offers, holds the peers, closes them with the
    server.

    Args:
        host: the server (its configuration, stages, admission, session count and cap).

    Attributes:
        peers: the open peer connections (each one a session).
    """

    def __init__(self, host: SessionHost) -> None:
        self.host = host
        self.peers: set[RtcPeer] = set()
        self.closing = False

    async def offer(self, request: Request) -> Response:
        """``POST /webrtc/offer`` (see the module docstring)."""
        try:
            return await self._offer(request)
        except OfferError as exc:
            logger.info("WebRTC offer from %s refused (%d): %s", request.client, exc.status, exc.message)
            headers = {"Cache-Control": "no-store"}
            if exc.retry_after_s is not None:
                headers["Retry-After"] = str(exc.retry_after_s)
            return PlainTextResponse(exc.message + "\n", exc.status, headers=headers)

    async def _offer(self, request: Request) -> Response:
        if not aiortc_installed():
            raise OfferError(http.HTTPStatus.NOT_IMPLEMENTED, INSTALL_HINT)
        try:
            from .peer import RtcPeer
        except ImportError as exc:  # installed but broken (a missing native library)
            raise OfferError(http.HTTPStatus.NOT_IMPLEMENTED, f"{INSTALL_HINT} ({exc})") from None
        sdp, start = parse_offer(await _body(request))
        check_offer(sdp)
        host = self.host
        unavailable = http.HTTPStatus.SERVICE_UNAVAILABLE
        if not host.ready:
            raise OfferError(unavailable, "server is warming up; try again shortly", SESSIONS_RETRY_S)
        if self.closing:
            raise OfferError(unavailable, "server is shutting down")
        if host.sessions >= host.max_sessions:
            metrics.ADMISSIONS.labels("refused", "sessions").inc()
            raise OfferError(unavailable, f"server full: {host.max_sessions} sessions (--max-sessions)",
                             SESSIONS_RETRY_S)
        peer = RtcPeer(host, request.client, self.peers.discard)
        host.sessions += 1  # no await since the check: a burst never admits cap + 1
        peer.counted = True
        self.peers.add(peer)
        try:
            answer = await peer.answer(sdp)
            await peer.start(start)
        except BaseException:
            await peer.close("bad_offer")
            raise
        return JSONResponse({"type": "answer", "sdp": answer}, headers={"Cache-Control": "no-store"})

    def attach(self, server: Server) -> None:
        """Make ``server.close()`` close the peers too, and ``server.wait_closed()`` wait for it."""
        close_along(server, self, "voxpipe-webrtc-close")

    async def aclose(self) -> None:
        """Close every peer (their sessions end), waiting at most :data:`CLOSE_GRACE_S`."""
        self.closing = True
        peers = list(self.peers)
        if peers:
            await asyncio.wait([asyncio.ensure_future(p.close("server")) for p in peers], timeout=CLOSE_GRACE_S)


async def _body(request: Request) -> bytes:
    """The request body, at most :data:`~.types.MAX_OFFER_BYTES`, within ``BODY_TIMEOUT_S``.

    Raises:
        OfferError: 413 too large, 408 too slow, 400 the client left.
    """
    body = bytearray()
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            async for piece in request.stream():
                body += piece
                if len(body) > MAX_OFFER_BYTES:
                    raise OfferError(http.HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                     f"request body over {MAX_OFFER_BYTES} bytes")
    except TimeoutError:
        raise OfferError(http.HTTPStatus.REQUEST_TIMEOUT,
                         f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    except ClientDisconnect:
        raise OfferError(http.HTTPStatus.BAD_REQUEST, "the client left before sending its whole request") from None
    return bytes(body)
