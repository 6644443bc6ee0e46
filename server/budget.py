"""Per-client input budgets: how far ahead of real time a client's audio may run, and how
many text frames it may send, before the server stops reading its socket.

A token bucket (the classic traffic-shaping algorithm, e.g. RFC 2697's committed burst)
per kind: it refills at ``rate`` units per second up to ``burst`` units; a frame takes its
units and may leave the bucket in debt, in which case the reader waits until the debt is
repaid before it handles the frame. Waiting loses no audio and no events: while the
session's reader waits, websockets stops reading the socket once its small receive queue
is full, and TCP flow control slows the client. Only that client waits; every other
session's reader goes on (each connection has its own task).

One frame may stall its reader for at most ``ServerConfig.read_stall_s``: what it holds
beyond that (a 4 MiB frame of 8 kHz PCM16 is 4 minutes of audio) is dropped. A reader
that stalled longer would leave the client's keepalive pong unread behind the queued
frames and the connection would die of its ping timeout; and a client whose frames each
hold a few milliseconds to seconds of audio, as every real one does, never reaches it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.config import ServerConfig

TEXT_UNIT_BYTES = 16 * 1024
"""A text frame counts once, and once more per full 16 KiB: parsing a 4 MiB frame costs like 256
small ones."""
MIN_FRAME_S = 0.002
"""Each binary frame costs at least 2 ms of audio: handling a frame costs the server
something whatever it holds, so a flood of empty or tiny frames is paced too (at 3x real
time: 1,500 frames/s; real clients send 10-100 ms per frame)."""
WARN_EVERY_S = 10.0
"""A throttled client is told (``error`` ``rate_limited``) at most this often."""


class TokenBucket:
    """A token bucket that may go into debt.

    Args:
        rate: units per second refilled (> 0). burst: capacity in units (> 0); the bucket
            starts full. clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.level = burst
        self._t = clock()

    def take(self, units: float, max_wait_s: float = math.inf) -> float | None:
        """Take ``units`` (≥ 0) now; returns the seconds to wait before using them (0 when
        the bucket covered them), or None — nothing taken — when that wait would exceed
        ``max_wait_s``. The debt is booked at once: a second call before the wait is over
        waits for both."""
        now = self.clock()
        self.level = min(self.burst, self.level + (now - self._t) * self.rate)
        self._t = now
        wait = max(0.0, (units - self.level) / self.rate)
        if wait > max_wait_s:
            return None
        self.level -= units
        return wait


@dataclass(slots=True)
class Pace:
    """What happens to a client's frame (or piece of one): it is handled after ``wait_s``
    seconds, or ``dropped`` (its wait would pass the frame's stall limit); ``warn``: send
    the client ``error`` ``rate_limited`` (the first throttled frame, and the first dropped
    one, then at most every :data:`WARN_EVERY_S` each)."""

    wait_s: float
    warn: bool
    dropped: bool = False


class ClientBudget:
    """The audio and text budgets of one connection (``ServerConfig.audio_rate_x`` ×
    real time with ``audio_burst_s`` of burst; ``text_rate`` frames/s with ``text_burst``).

    Args:
        cfg: the server configuration. clock: as for :class:`TokenBucket`.
    """

    def __init__(self, cfg: ServerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.audio = TokenBucket(cfg.audio_rate_x, cfg.audio_burst_s, clock)
        self.text = TokenBucket(cfg.text_rate, cfg.text_burst, clock)
        self.clock = clock
        self._warned_at = {False: -math.inf, True: -math.inf}  # when told of a wait, of a drop
        self.throttled_s = 0.0  # total wait imposed on this client (s)

    def audio_seconds(self, seconds: float, max_wait_s: float = math.inf) -> Pace:
        """``seconds`` of audio arrived (its duration in the declared format); dropped if
        it would have to wait more than ``max_wait_s``."""
        return self._pace(self.audio.take(seconds, max_wait_s))

    def text_frame(self, n_bytes: int, max_wait_s: float = math.inf) -> Pace:
        """A text frame of ``n_bytes`` arrived (it counts 1 plus 1 per full 16 KiB)."""
        return self._pace(self.text.take(1 + n_bytes // TEXT_UNIT_BYTES, max_wait_s))

    def _pace(self, wait_s: float | None) -> Pace:
        if wait_s is not None and wait_s <= 0.0:
            return Pace(0.0, False)
        self.throttled_s += wait_s or 0.0
        now = self.clock()
        dropped = wait_s is None
        warn = now - self._warned_at[dropped] >= WARN_EVERY_S
        if warn:
            self._warned_at[dropped] = now
        return Pace(wait_s or 0.0, warn, dropped)
