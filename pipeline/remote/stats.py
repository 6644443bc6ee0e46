"""The front end's cached view of a stage deployment's load, refreshed off the event loop.

A stage's ``load()`` is read by admission on the event loop for every turn; it must never
wait for a replica. A :class:`StatsPoller` thread asks the deployment's ``stats`` method
every ``interval_s`` (one call per known replica: Serve routes each to some replica) and
keeps the latest answer of each replica; ``load()`` reads their sum (:class:`DeploymentLoad`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pipeline.remote.types import DeploymentLoad, ReplicaStats
from pipeline.serving.types import StageLoad

logger = logging.getLogger(__name__)

POLL_S = 0.5
"""How often the stats are refreshed (s)."""
STALE_S = 3.0
"""A replica not heard from for this long no longer counts (it died or was scaled down)."""
CALL_TIMEOUT_S = 2.0
"""One ``stats`` call's deadline (s): a slow answer is skipped, the old values stay."""


class StatsCache:
    """The latest :class:`ReplicaStats` of each replica of one deployment (thread-safe).

    Args:
        clock: monotonic seconds (tests inject their own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[float, ReplicaStats]] = {}
        self.deployment = DeploymentLoad()
        self.last: ReplicaStats | None = None

    def update(self, stats: ReplicaStats) -> None:
        """Record one replica's answer; forget replicas silent for :data:`STALE_S`."""
        now = self._clock()
        with self._lock:
            self._latest[stats.replica] = (now, stats)
            self._latest = {k: v for k, v in self._latest.items() if now - v[0] <= STALE_S}
            self.deployment = DeploymentLoad.of([s for _, s in self._latest.values()])
            self.last = stats

    @property
    def load(self) -> StageLoad:
        """The replicas' summed load (one snapshot; zeros before the first answer)."""
        return self.deployment.load

    @property
    def replicas(self) -> int:
        """Replicas the deployment reports (0 before the first answer)."""
        return self.deployment.replicas


class StatsPoller:
    """A daemon thread that refreshes a :class:`StatsCache` from ``fetch`` (a blocking
    call that returns one replica's stats, e.g. ``handle.stats.remote().result(...)``).

    Args:
        name: the stage, for the thread's name and logs.
        fetch: ``fetch(timeout_s) -> ReplicaStats``; may raise (the values stay as they were).
        cache: where answers go.
        interval_s: the refresh period (s).
    """

    def __init__(self, name: str, fetch: Callable[[float], ReplicaStats], cache: StatsCache, *,
                 interval_s: float = POLL_S) -> None:
        self.name, self._fetch, self.cache, self.interval_s = name, fetch, cache, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"voxpipe-{name}-stats")

    def refresh(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Ask once per known replica (at least once), concurrently; record what answers.

        Raises:
            the last call's error when no call answered.
        """
        calls = [self._pool.submit(self._fetch, timeout_s) for _ in range(max(1, min(4, self.cache.replicas)))]
        error: BaseException | None = None
        answered = False
        for call in calls:
            try:
                self.cache.update(call.result())
                answered = True
            except Exception as exc:  # noqa: BLE001 - a missed refresh keeps the old values
                error = exc
        if not answered and error is not None:
            raise error

    def start(self) -> None:
        """Start refreshing (idempotent)."""
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name=f"voxpipe-{self.name}-stats", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop refreshing and wait for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=CALL_TIMEOUT_S + 1)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception as exc:  # noqa: BLE001 - a replica restarting; try again next period
                logger.debug("%s stats: %s", self.name, exc)
