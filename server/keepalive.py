"""Keepalive that a throttled client survives.

websockets' own keepalive closes a connection whose pong is 20 s late. A client that the
server throttles (server/budget.py: its reader stops reading) has its pong queued in TCP
behind its own unread frames — megabytes in the socket buffers, minutes of audio at the
budget's pace — so it would be closed with 1011 although it is alive and sending. Here a
frame read from the client within the timeout counts as much as a pong: a connection is
closed only when neither came (a half-open connection, a dead peer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from websockets.exceptions import ConnectionClosed

logger = logging.getLogger(__name__)

CLOSE_KEEPALIVE = 1011
"""Close code when the peer answered nothing (as websockets' own keepalive uses)."""


async def keepalive(ws, last_frame: Callable[[], float], interval_s: float, timeout_s: float,
                    on_timeout: Callable[[], object] | None = None) -> None:
    """Ping ``ws`` every ``interval_s``; close it with 1011 when twice ``timeout_s`` pass
    with no pong and no frame read (``last_frame()``: loop time of the latest, from the
    reader), calling ``on_timeout()`` first. Runs until the connection closes or the task
    is cancelled.

    Args:
        ws: a websockets connection (``ping()``, ``close()``).
        last_frame: when the session's reader last got a frame (``loop.time()`` seconds).
        interval_s, timeout_s: seconds (> 0).
        on_timeout: told that the keepalive closes the connection (the session's close reason).
    """
    loop = asyncio.get_running_loop()
    try:
        while True:
            await asyncio.sleep(interval_s)
            pong = await ws.ping()
            sent = loop.time()
            if await _answered(pong, last_frame, sent, timeout_s) or await _answered(pong, last_frame, sent, timeout_s):
                continue  # a second chance: one late timer on a busy event loop must not close a live client
            logger.info("keepalive: no pong and no frame for %.0f s: closing", 2 * timeout_s)
            if on_timeout is not None:
                on_timeout()
            await ws.close(CLOSE_KEEPALIVE, "keepalive ping timeout")
            return
    except ConnectionClosed:
        return


async def _answered(pong: asyncio.Future, last_frame: Callable[[], float], sent: float, timeout_s: float) -> bool:
    """Within ``timeout_s``: the pong came, or (checked at the end) a frame was read after
    the ping was ``sent``: the client is alive, its pong queued behind its own frames."""
    try:
        await asyncio.wait_for(asyncio.shield(pong), timeout_s)
        return True
    except TimeoutError:
        return last_frame() >= sent
