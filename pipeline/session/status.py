"""A session's view of the server's service level: ``server.status`` events.

Subscribes to the :class:`~pipeline.serving.governor.Governor` once the session has started,
tells the client the conditions in force right after ``session.started`` when the server is
degraded, then every change, in order (one sender task drains a queue)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pipeline.serving.governor import Governor
from pipeline.session import events as ev
from pipeline.session.types import Outbox


class StatusFeed:
    """``server.status`` for one session.

    Args:
        governor: the server's service level (None: never sends anything).
        out: the session's outbox.
        spawn: starts a task the session owns (cancelled when it closes).
    """

    def __init__(self, governor: Governor | None, out: Outbox, spawn: Callable[..., asyncio.Task]) -> None:
        self.governor, self.out, self._spawn = governor, out, spawn
        self._queue: asyncio.Queue[list[ev.Condition]] = asyncio.Queue()
        self._unsubscribe: Callable[[], None] | None = None
        self._sender: asyncio.Task | None = None

    async def started(self) -> None:
        """The session (re)started: from now on the client hears of every change; if the
        server is degraded now, it hears that at once."""
        governor = self.governor
        if governor is None:
            return
        if self._unsubscribe is None:
            self._unsubscribe = governor.subscribe(self._queue.put_nowait)
            self._sender = self._spawn(self._send_all())
        conditions = governor.conditions()
        if conditions:
            self._queue.put_nowait(conditions)

    def close(self) -> None:
        """Stop listening (the session's tasks, the sender among them, are cancelled by the session)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None

    async def _send_all(self) -> None:
        while True:
            conditions = await self._queue.get()
            await self.out.send(ev.ServerStatus(degraded=bool(conditions), conditions=conditions))
