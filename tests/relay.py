"""A loopback TCP relay for tests: voxpipe ⇄ relay ⇄ a real HTTP server, recording what it
sees, and able to play a dead or stalled server.

It watches OpenAI-style streaming chat completions: a response is *open* from a client's
``POST .../chat/completions`` until the server sends a chunk with a ``finish_reason`` (or
``data: [DONE]``). A client that closes its connection while a response is open cut the
stream (:attr:`Relay.cut`); the relay then closes its upstream connection, so the server
sees the disconnect too.
"""

from __future__ import annotations

import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

_FINISHED = re.compile(rb'"finish_reason":\s*"|data: \[DONE\]')


@dataclass(eq=False)
class _Conn:
    client: socket.socket
    upstream: socket.socket | None = None
    open_response: bool = False
    tail: bytes = b""  # the last bytes from the server (a finish marker may span two reads)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class Relay:
    """Forward ``127.0.0.1:port`` to ``127.0.0.1:upstream_port``.

    Attributes:
        port: where clients connect.
        requests: every request's bytes from clients (heads and bodies, as they came).
        cut: ``time.monotonic()`` of each client close while a response was still streaming.
        stall: accept connections but never forward them nor answer (a hung server).
        pace_s: wait this long before forwarding each read from the server (a slower
            server: a reply is certainly still streaming a few seconds after it began).
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.requests: list[bytes] = []
        self.cut: list[float] = []
        self.stall = False
        self.pace_s = 0.0
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._listener = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._start_accepting()

    @staticmethod
    def _listen(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen(64)
        return s

    def _start_accepting(self) -> None:
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def kill(self) -> None:
        """Die like a crashed server: stop listening (new connections are refused) and reset
        every connection, mid-stream or not."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            self._close(c, killed=True)

    def revive(self) -> None:
        """Listen again on the same port and forward (a restarted server)."""
        self.stall = False
        self._listener = self._listen(self.port)
        self._start_accepting()

    def request_text(self) -> str:
        """Every request seen, as text."""
        return b"".join(self.requests).decode("utf-8", "replace")

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by kill()
            conn = _Conn(client)
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, c: _Conn) -> None:
        if not self.stall:
            try:
                c.upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
                c.upstream.settimeout(None)
            except OSError:
                self._close(c)
                return
            threading.Thread(target=self._pump_down, args=(c,), daemon=True).start()
        while True:  # client → server
            try:
                data = c.client.recv(65536)
            except OSError:
                data = b""
            if not data:
                with c.lock:
                    if c.open_response and not c.closed:
                        self.cut.append(time.monotonic())
                self._close(c)
                return
            self.requests.append(data)
            if b"/chat/completions" in data:
                c.open_response = True
            if c.upstream is not None:
                try:
                    c.upstream.sendall(data)
                except OSError:
                    self._close(c)
                    return

    def _pump_down(self, c: _Conn) -> None:
        """server → client."""
        assert c.upstream is not None
        while True:
            try:
                data = c.upstream.recv(65536)
            except OSError:
                data = b""
            if not data:
                self._close(c)
                return
            seen = c.tail + data
            if _FINISHED.search(seen):
                c.open_response = False
            c.tail = seen[-64:]
            if self.pace_s:
                time.sleep(self.pace_s)
            try:
                c.client.sendall(data)
            except OSError:
                self._close(c)
                return

    def _close(self, c: _Conn, *, killed: bool = False) -> None:
        with c.lock:
            if c.closed:
                return
            c.closed = True
        for s in (c.client, c.upstream):
            if s is None:
                continue
            try:  # SHUT_RD wakes this socket's reader thread; RDWR also sends a FIN
                s.shutdown(socket.SHUT_RD if killed else socket.SHUT_RDWR)
                if killed:  # an abortive close (RST), as a crashed process's sockets
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            s.close()
