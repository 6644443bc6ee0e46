"""The session's frame reader, with the idle timeout kept by one watchdog task.

A client streams 50 frames a second; an ``asyncio.timeout`` around each ``recv`` schedules
and cancels a timer per frame (about a fifth of a silent session's cost on the event loop).
:class:`FrameReader` instead records when each frame came, and a watchdog wakes only when
the idle deadline could have passed: it cancels the read in progress (``recv`` is
cancellation-safe) and the reader raises :class:`IdleClient`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from websockets.asyncio.server import ServerConnection

RECHECK_S = 1.0
"""While a frame is being handled (not awaited) the watchdog looks again this soon (s)."""


class IdleClient(Exception):
    """The client sent no frame for ``ServerConfig.idle_timeout_s``."""


class FrameReader:
    """Read a connection's frames; :meth:`recv` raises :class:`IdleClient` once no frame
    has come for ``idle_s`` seconds while it waited and ``busy()`` is false (a user
    listening to a long reply is not idle: the idle period then counts from the end of the
    reply, as the client still plays the audio that was sent ahead).

    Args:
        ws: the connection.
        idle_s: seconds (0: no idle timeout).
        busy: whether a reply is in progress.

    ``last`` is the loop time of the latest frame (or of the reader's creation); ``waited``
    the seconds :meth:`recv` spent waiting for frames to come (not those already there).
    Run :meth:`watch` as a task beside the reading task while it reads.
    """

    def __init__(self, ws: ServerConnection, idle_s: float, busy: Callable[[], bool]) -> None:
        self.ws, self.idle_s, self.busy = ws, idle_s, busy
        self._loop = asyncio.get_running_loop()
        self.last = self._loop.time()
        self.waited = 0.0
        self._waiting: asyncio.Task | None = None  # the task awaiting recv, if one is
        self._fired = False

    async def recv(self) -> str | bytes:
        """The next frame (text or bytes); raises :class:`IdleClient` (see the class) or
        ``ConnectionClosed``."""
        self._waiting = asyncio.current_task()
        t0 = self._loop.time()
        try:
            message = await self.ws.recv()
        except asyncio.CancelledError:
            task = self._waiting
            if self._fired and task is not None and task.uncancel() == 0:
                raise IdleClient from None
            raise
        finally:
            self._waiting = None
            self.waited += self._loop.time() - t0
        self.last = self._loop.time()
        return message

    async def watch(self) -> None:
        """Until cancelled (or the timeout fires): wake when the idle deadline may have
        passed and end the read in progress if it has."""
        if not self.idle_s:
            return
        loop = self._loop
        extended = self.last  # the deadline also runs from here: the end of a reply (not a frame)
        replying = False  # a reply was in progress at the last look: look every RECHECK_S
        while True:
            wake = max(self.last, extended) + self.idle_s
            if replying:
                wake = min(wake, loop.time() + min(RECHECK_S, self.idle_s))
            await asyncio.sleep(max(0.0, wake - loop.time()))
            if replying:  # the idle period restarts when the reply ends
                replying = self.busy()
                extended = loop.time()
                continue
            if loop.time() - max(self.last, extended) < self.idle_s:
                continue  # a frame came meanwhile
            task = self._waiting
            if task is None:  # a frame is being handled: look again soon
                await asyncio.sleep(min(RECHECK_S, self.idle_s))
                continue
            if self.busy():  # a reply in progress (its audio runs ahead of playback)
                replying, extended = True, loop.time()
                continue
            self._fired = True
            task.cancel()
            return
