"""Who may use the server: ``Host``, ``Origin`` and bearer-token checks, made on the HTTP
request before any WebSocket upgrade (so a refused client costs no session).

- **Host** (DNS rebinding): a server listening on loopback answers only requests whose
  ``Host`` names a loopback host (``localhost``, ``127.0.0.1``, ``[::1]``, any port) or one
  of ``ServerConfig.allow_hosts``; otherwise a page on ``evil.example`` that re-points its
  name at 127.0.0.1 could read ``/metrics`` and drive ``/ws``. A non-loopback server has a
  token anyway; its ``Host`` is checked only when ``allow_hosts`` is given.
- **Origin** (cross-site WebSocket hijacking; browsers send ``Origin`` on every WebSocket
  handshake, and WebSockets are not subject to CORS): ``/ws`` accepts a request without
  ``Origin`` (not a browser), the page's own origin (``Origin``'s host and port equal the
  ``Host`` header), and ``ServerConfig.allow_origins`` (``*`` = any). The same holds for the
  HTTP API under ``/v1/`` (server/openai_api.py: a cross-site page's ``fetch`` must not
  spend the LLM) and the WebRTC signalling under ``/webrtc/`` (server/webrtc/).
- **Token**: with ``ServerConfig.token`` set, ``/ws``, ``/v1/...`` and ``/webrtc/...`` need
  ``Authorization: Bearer TOKEN`` or the query parameter ``token=TOKEN`` (browsers cannot set headers on a WebSocket);
  ``/metrics`` needs it too when the server listens on a non-loopback address. Compared in
  constant time (:func:`hmac.compare_digest`). ``/twilio`` is the exception: Twilio's
  ``<Stream>`` URL takes no query string and Twilio sends no ``Authorization``, so its token
  comes in the stream's ``start`` message (a ``<Parameter name="token">``) and
  :mod:`server.twilio.wire` checks it there; its ``Origin`` is checked as for ``/ws``.

The web page, ``/healthz`` and static files stay open: they hold no secret.
"""

from __future__ import annotations

import hmac
import http
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

from websockets.datastructures import MultipleValuesError

from pipeline.config import ServerConfig, is_loopback

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
"""Host names a loopback server always accepts (plus any 127.x address and *.localhost)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused: HTTP ``status`` and a one-line ``message``; ``reason`` is
    the metrics label (``host`` | ``origin`` | ``token`` | ``header``: a duplicate
    ``Host``, ``Origin`` or ``Authorization``)."""

    status: http.HTTPStatus
    reason: str
    message: str


def split_host(value: str) -> tuple[str, int | None]:
    """``Host``-style ``name[:port]`` (``[v6]:port`` too) → (lower-case name, port or None).

    Raises:
        ValueError: not a host (e.g. a bad port).
    """
    parts = urlsplit("//" + value.strip())
    if parts.hostname is None:
        raise ValueError(f"not a host: {value!r}")
    return parts.hostname.lower(), parts.port


class EdgeGuard:
    """The checks above for one server configuration.

    Args:
        cfg: ``host`` (is it loopback?), ``token``, ``allow_origins``, ``allow_hosts``.
    """

    def __init__(self, cfg: ServerConfig) -> None:
        self.loopback = is_loopback(cfg.host)
        self.token = cfg.token.encode() if cfg.token else None
        self.any_origin = "*" in cfg.allow_origins
        self.origins = {o.strip().rstrip("/").lower() for o in cfg.allow_origins if o.strip() != "*"}
        self.hosts = {split_host(h)[0] for h in cfg.allow_hosts}
        if not self.loopback and self.hosts:
            self.hosts.add(cfg.host.strip().lower().removeprefix("[").removesuffix("]"))  # the address it listens on

    def check(self, path: str, query: str, headers) -> Refusal | None:
        """Check one HTTP request (any path); None = let it through.

        Args:
            path: the URL path without the query. query: the raw query string.
            headers: the request headers (``websockets.datastructures.Headers`` or a dict).
        """
        try:
            return self._check(path, query, headers)
        except MultipleValuesError as exc:  # two Host/Origin/Authorization headers: ambiguous, refused
            return Refusal(http.HTTPStatus.BAD_REQUEST, "header", f"duplicate header {exc}")

    def _check(self, path: str, query: str, headers) -> Refusal | None:
        if not self._host_ok(headers.get("Host")):
            return Refusal(http.HTTPStatus.FORBIDDEN, "host",
                           "Host not allowed: use localhost or 127.0.0.1, or start the server with --allow-host")
        if path in ("/ws", "/twilio") or path.startswith(("/v1/", "/webrtc/")):
            origin = headers.get("Origin")
            if origin is not None and not self._origin_ok(origin, headers.get("Host")):
                return Refusal(http.HTTPStatus.FORBIDDEN, "origin",
                               f"Origin {origin[:100]!r} not allowed: open the page from this server, "
                               "or start it with --allow-origin")
        if self.token is not None and (path == "/ws" or path.startswith(("/v1/", "/webrtc/"))
                                       or (path == "/metrics" and not self.loopback)):
            if not self._token_ok(query, headers.get("Authorization")):
                return Refusal(http.HTTPStatus.UNAUTHORIZED, "token",
                               "a valid token is required: Authorization: Bearer TOKEN, or ?token=TOKEN")
        return None

    def _host_ok(self, host: str | None) -> bool:
        if not self.loopback and not self.hosts:
            return True
        if host is None:  # HTTP/1.1 requires Host; websockets' parser already enforces it
            return False
        try:
            name = split_host(host)[0]
        except ValueError:
            return False
        return name in LOOPBACK_HOSTS or is_loopback(name) or name in self.hosts

    def _origin_ok(self, origin: str, host: str | None) -> bool:
        if self.any_origin:
            return True
        origin = origin.strip().rstrip("/").lower()
        if origin in self.origins:
            return True
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or host is None:
            return False  # "null" (a file:// page, a sandboxed frame) is nobody's own origin
        default = 443 if parts.scheme == "https" else 80
        try:
            o_name, o_port = parts.hostname or "", parts.port or default
            h_name, h_port = split_host(host)
        except ValueError:
            return False
        return o_name == h_name and o_port == (h_port or default)

    def _token_ok(self, query: str, authorization: str | None) -> bool:
        assert self.token is not None
        given: list[str] = []
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer":
                given.append(value.strip())
        given += parse_qs(query, keep_blank_values=True).get("token", [])
        return any(hmac.compare_digest(g.encode(), self.token) for g in given)
