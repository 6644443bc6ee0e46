"""The server under test: a ``voxpipe serve`` child process on a free loopback port, as
every end-to-end benchmark (``bench voice``, ``edge``, ``load``, ``silent``) starts it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

READY_S = 600.0
"""How long :func:`start_server` waits for ``/healthz`` (s): the first start loads every model."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(llm: str, port: int, extra: list[str], log: str | None = None) -> subprocess.Popen:
    """Start ``voxpipe serve --llm LLM --port PORT EXTRA`` and wait for its ``/healthz``.

    Args:
        llm: the ``--llm`` value (a preset or a path).
        port: the port to serve on (:func:`free_port`).
        extra: more ``voxpipe serve`` options, appended.
        log: a file for its INFO log; None: WARNING and up, discarded.

    Raises:
        RuntimeError: the server exited, or was not ready within :data:`READY_S`.
    """
    sink = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--llm", llm, "--port", str(port),
                             "--log-level", "INFO" if log else "WARNING", *extra],
                            stdout=subprocess.DEVNULL, stderr=sink)
    deadline = time.time() + READY_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server not ready")


def stop_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """Stop a server :func:`start_server` started: SIGTERM, then SIGKILL after ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
