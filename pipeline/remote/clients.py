"""Front-end clients of the stage deployments, implementing :mod:`pipeline.stages`.

``Engines(vad=<local Silero>, asr=RemoteAsr(...), llm=RemoteLlm(...), tts=RemoteTts(...))``
serves sessions exactly as the in-process engines do. Calls are awaitable handle calls
(``await handle.run.remote(...)``): the event loop never waits on a replica. ``load()``
reads a cache that a :class:`~pipeline.remote.stats.StatsPoller` thread refreshes every 0.5 s.

Errors: see :mod:`pipeline.remote.errors` (``busy`` for a full stage, a typed error for the
turn when a replica dies).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from typing import Any, cast

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from pipeline.asr.types import AsrRequest, DecodeRequest, DecodeResult, Transcript
from pipeline.errors import Busy
from pipeline.llm.types import FinishReason, GenRequest, GenStats
from pipeline.remote.errors import translate
from pipeline.remote.stats import StatsCache, StatsPoller
from pipeline.remote.types import RemoteStageName, ReplicaStats, StageUnavailable
from pipeline.serving.types import StageLoad
from pipeline.tools.types import ToolSpec
from pipeline.tts.types import Phrase, Speech

logger = logging.getLogger(__name__)

COUNT_TIMEOUT_S = 30.0
"""``count_tokens`` waits this long at most (s): it holds a worker thread meanwhile."""


class RemoteStage:
    """What every client does: hold the deployment's handle, keep its load cached.

    Args:
        stage: the deployment's stage name (``asr``, ``llm``, ``tts``).
        handle: a ``DeploymentHandle`` of the stage deployment.
    """

    def __init__(self, stage: RemoteStageName, handle: DeploymentHandle) -> None:
        self.stage, self.handle = stage, handle
        self.cache = StatsCache()
        self.poller = StatsPoller(stage, self._fetch_stats, self.cache)

    def _fetch_stats(self, timeout_s: float) -> ReplicaStats:
        """One replica's stats (blocking: the poller's thread only)."""
        return self.handle.stats.remote().result(timeout_s=timeout_s)

    def load(self) -> StageLoad:
        """The replicas' load, summed over them (cached, ≤ 0.5 s old; ``step_ms`` their mean,
        ``kv_budget`` their budgets' sum)."""
        return self.cache.load

    def start(self) -> None:
        """Start refreshing the cached load (idempotent)."""
        self.poller.start()

    def stop(self) -> None:
        """Stop refreshing; the deployment itself runs on (Serve owns it)."""
        self.poller.stop()

    async def _call(self, response: Any) -> Any:
        """Await a unary handle call; cancelling the await cancels the replica's request.

        Raises:
            Busy, StageUnavailable: see :func:`~pipeline.remote.errors.translate`.
        """
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as exc:
            raise translate(self.stage, exc) from exc


class RemoteAsr(RemoteStage):
    """:class:`~pipeline.stages.AsrStage` over the ``asr`` deployment."""

    def __init__(self, handle: DeploymentHandle) -> None:
        super().__init__("asr", handle)

    @property
    def multilingual(self) -> bool:
        """False for an English-only model (from the replicas' stats)."""
        last = self.cache.last
        return bool(last and last.multilingual)

    @property
    def languages(self) -> list[str]:
        """ISO codes the model decodes (from the replicas' stats)."""
        last = self.cache.last
        return list(last.languages) if last else ["en"]

    async def run(self, item: DecodeRequest | AsrRequest) -> DecodeResult | Transcript:
        """Decode ``item`` in a replica (batched there with other sessions' requests).

        Raises:
            Busy: the deployment or its engine is full; StageUnavailable: the replica failed.
        """
        return await self._call(self.handle.run.remote(item))


class RemoteTts(RemoteStage):
    """:class:`~pipeline.stages.TtsStage` over the ``tts`` deployment."""

    def __init__(self, handle: DeploymentHandle) -> None:
        super().__init__("tts", handle)

    async def run(self, item: str | Phrase, *, priority: int | None = None) -> Speech:
        """Synthesize one phrase in a replica (``priority`` 0: a reply's first phrase).

        Raises:
            Busy: the deployment or its engine is full, or the replica's breaker is open;
            StageUnavailable: the replica failed.
        """
        return await self._call(self.handle.run.remote(item, priority))


class RemoteLlm(RemoteStage):
    """:class:`~pipeline.stages.LlmStage` over the ``llm`` deployment.

    :meth:`submit` must refuse at once (``Busy``) when the stage is full, before the reply
    starts; a handle call only learns that when it is first awaited. So it refuses from what
    this front end knows: the replicas' queues as last polled (``queue_size`` per replica:
    what the in-process engine refuses at) and its own streams in flight (≥ ``capacity``: what Serve's
    router would refuse, ``replicas × max_ongoing_requests + max_queued_requests``).
    Back-pressure that still comes later (another front end filled the queue meanwhile)
    ends that reply with a typed error.

    Args:
        handle: a ``DeploymentHandle`` of the ``llm`` deployment.
        queue_size: each replica's engine queue bound (``LlmConfig.queue_size``).
        max_ongoing: the deployment's ``max_ongoing_requests`` (None: unknown).
        max_queued: its ``max_queued_requests`` (None or < 0: unbounded).
    """

    def __init__(self, handle: DeploymentHandle, *, queue_size: int, max_ongoing: int | None = None,
                 max_queued: int | None = None) -> None:
        super().__init__("llm", handle)
        self._stream_handle = handle.options(stream=True)
        self.queue_size, self.max_ongoing, self.max_queued = queue_size, max_ongoing, max_queued
        self._open: weakref.WeakSet[RemoteTextStream] = weakref.WeakSet()  # a dropped stream stops counting
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int | None:
        """Streams this front end may have in flight before Serve refuses (None: unbounded)."""
        if self.max_ongoing is None or self.max_queued is None or self.max_queued < 0:
            return None
        return max(1, self.cache.replicas) * self.max_ongoing + self.max_queued

    @property
    def in_flight(self) -> int:
        """This front end's streams not ended yet."""
        return len(self._open)

    def submit(self, req: GenRequest) -> RemoteTextStream:
        """Start ``req`` in a replica; returns its stream of text deltas.

        Raises:
            Busy: the replicas' queues were full at the last poll, or this front end
                already has ``capacity`` streams in flight.
        """
        seen = self.cache.deployment
        if seen.load.depth >= self.queue_size * max(1, seen.replicas):
            raise Busy(f"llm is busy: {seen.load.depth} requests already queued in its replicas")
        cap = self.capacity
        if cap is not None and self.in_flight >= cap:
            raise Busy(f"llm is busy: {self.in_flight} replies in flight, the deployment takes {cap}")
        response = cast(DeploymentResponseGenerator, self._stream_handle.generate.remote(req))
        stream = RemoteTextStream(response, on_end=self._ended)
        with self._lock:
            self._open.add(stream)
        return stream

    def _ended(self, stream: RemoteTextStream) -> None:
        with self._lock:
            self._open.discard(stream)

    def count_tokens(self, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> int:
        """Prompt tokens of ``messages`` with ``tools`` offered (a blocking call to a replica: off the event loop only).

        Raises:
            Busy, StageUnavailable: as for any call; TimeoutError: no answer within
                :data:`COUNT_TIMEOUT_S` (e.g. every replica is restarting).
        """
        try:
            return int(self.handle.count_tokens.remote(messages, tools).result(timeout_s=COUNT_TIMEOUT_S))
        except Exception as exc:
            raise translate(self.stage, exc) from exc

    def end_session(self, session: str) -> None:
        """``session`` ended: the replica it reaches may drop its cached KV (fire and forget;
        with several replicas, the others evict it as the least recently used)."""
        try:
            self.handle.end_session.remote(session)
        except Exception as exc:  # noqa: BLE001 - only a cache hint
            logger.debug("llm end_session(%s): %s", session, exc)


class RemoteTextStream:
    """A reply streamed from an LLM replica (:class:`~pipeline.stages.TextStream`):
    ``async for delta in stream``; ``stats`` arrive with the end of the stream.

    Raises:
        StageUnavailable: from iteration, when the replica died or failed mid-reply (or
            refused it after it started); Busy never (see :class:`RemoteLlm`).
    """

    def __init__(self, response: DeploymentResponseGenerator, *, on_end: Any) -> None:
        self.stats = GenStats()
        self._response = response
        self._on_end = on_end
        self._ended = False

    def __aiter__(self) -> RemoteTextStream:
        return self

    async def __anext__(self) -> str:
        while not self._ended:
            try:
                item = await self._response.__anext__()
            except StopAsyncIteration:
                self._end(self.stats.finish_reason or FinishReason.STOP)
                raise
            except asyncio.CancelledError:
                self.abort()
                raise
            except Exception as exc:
                self._end(FinishReason.ERROR)
                err = translate("llm", exc)
                if isinstance(err, Busy):  # the reply has started: a refusal now is its failure
                    raise StageUnavailable("llm", f"refused the reply after it started: {err}") from exc
                raise err from exc
            if isinstance(item, GenStats):
                self.stats = item
                continue
            return str(item)
        raise StopAsyncIteration

    def abort(self) -> None:
        """Stop generating: cancels the handle call, which raises ``CancelledError`` in the
        replica's generator and frees its batch slot (idempotent)."""
        if not self._ended:
            self._end(FinishReason.ABORT)
            try:
                self._response.cancel()
            except Exception as exc:  # noqa: BLE001 - the request may be gone already
                logger.debug("llm abort: %s", exc)

    def _end(self, reason: FinishReason) -> None:
        if not self._ended:
            self._ended = True
            if self.stats.finish_reason is None:
                self.stats.finish_reason = reason
            self._on_end(self)
