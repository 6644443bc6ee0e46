"""The stage deployments: one voxpipe engine per Serve replica.

Each replica loads its stage's model when Serve hands it its ``user_config``
(:meth:`_Replica.reconfigure`: a partial :class:`~pipeline.config.VoxpipeConfig`, see
:mod:`pipeline.remote.settings`), warms it up, and serves many concurrent handle calls
with the same engine the in-process server runs — so ASR decodes from many sessions batch
together inside the replica, and LLM requests join its continuous batch. The serving
policies that guard an engine (out-of-memory ladder, circuit breaker, injected faults) run
inside the replica too, with their own :class:`~pipeline.serving.governor.Governor`.

Errors cross the process boundary as Ray wraps them (``RayTaskError`` with the
original as ``cause``): :class:`~pipeline.errors.Busy` keeps its ``reason`` and
``retry_after_ms``. :mod:`pipeline.remote.errors` maps them back in the front end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from ray import serve
from ray.serve import Deployment
from ray.serve.handle import DeploymentHandle

from pipeline.asr.types import AsrRequest, DecodeRequest, DecodeResult, Transcript
from pipeline.config import VoxpipeConfig
from pipeline.engines import load_stage
from pipeline.errors import Busy
from pipeline.fault_rules import parse_rules
from pipeline.llm.types import GenRequest, GenStats
from pipeline.remote.settings import STAGE_SECTIONS, config_from_user
from pipeline.remote.types import INGRESS_NAME, RemoteStageName, ReplicaStats
from pipeline.serving.faults import FaultInjector, injected
from pipeline.serving.governor import TICK_S, Governor
from pipeline.tools.types import ToolSpec
from pipeline.tts.types import Phrase, Speech

logger = logging.getLogger(__name__)

HEALTH_DEADLINE_S = 20.0
"""A health probe (one tiny forward pass) slower than this marks the replica unhealthy
(Serve's own ``health_check_timeout_s`` is longer: the probe's deadline speaks first)."""
HEALTH_SESSION = "voxpipe-health"
"""The session id of the LLM's health probes (their cached KV is released at once)."""


class _Replica:
    """What every stage replica does: load on ``reconfigure``, report stats, check health."""

    stage: RemoteStageName

    def __init__(self) -> None:
        self.engine: Any = None
        self.cfg: VoxpipeConfig | None = None
        self._settings: dict[str, Any] | None = None
        self._governor: Governor | None = None
        self._ticking = threading.Event()

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config``: load (or, when the stage's settings changed, reload) the
        model, warm it up, then arm the fault rules. Slow: a model load.

        Raises:
            ValueError: a bad ``user_config`` (see :func:`config_from_user`); the loaders'
                errors (ModelNotInstalled, FileNotFoundError).
        """
        cfg = config_from_user(user_config)
        settings = {s: user_config.get(s) for s in STAGE_SECTIONS[self.stage]}
        if settings == self._settings and self.engine is not None:
            return
        t0 = time.perf_counter()
        engine: Any = await asyncio.to_thread(lambda: load_stage(cfg, self.stage))
        governor = Governor(cfg, fallback=False, faults=FaultInjector(parse_rules(cfg.degrade.faults)))
        governor.attach({self.stage: engine})
        engine.start()
        old, self.engine, self.cfg, self._governor, self._settings = self.engine, engine, cfg, governor, settings
        if old is not None:
            await asyncio.to_thread(old.stop)
        await self._probe()  # the warm-up: the first caller does not pay for lazy initialisation
        governor.faults.arm()
        self._start_ticking()
        logger.info("%s replica ready in %.1f s", self.stage, time.perf_counter() - t0)

    def _start_ticking(self) -> None:
        """Step the replica's ladders down and time its breakers out, every ``TICK_S``."""
        if self._ticking.is_set():
            return
        self._ticking.set()

        def tick() -> None:
            while True:
                governor = self._governor
                if governor is not None:
                    governor.tick()
                time.sleep(TICK_S)

        threading.Thread(target=tick, name=f"voxpipe-{self.stage}-governor", daemon=True).start()

    def _engine(self) -> Any:
        """The loaded engine.

        Raises:
            RuntimeError: no ``user_config`` has loaded one yet.
        """
        if self.engine is None:
            raise RuntimeError(f"{self.stage} replica has no model yet (no user_config applied)")
        return self.engine

    def stats(self) -> ReplicaStats:
        """This replica's load (counters only: cheap)."""
        engine = self._engine()
        ctx = serve.get_replica_context()
        return ReplicaStats(replica=ctx.replica_tag, replicas=ctx.world_size, load=engine.load(), at=time.time(),
                            **self._extra_stats(engine))

    def _extra_stats(self, engine: Any) -> dict[str, Any]:
        return {}

    async def check_health(self) -> None:
        """Serve's health check: one tiny forward pass within :data:`HEALTH_DEADLINE_S`.
        A full queue (``Busy``) or an injected fault counts as alive.

        Raises:
            RuntimeError: the probe failed or missed its deadline (Serve then restarts
                the replica).
        """
        self._engine()
        try:
            await asyncio.wait_for(self._probe(), HEALTH_DEADLINE_S)
        except Busy:
            return
        except TimeoutError:
            raise RuntimeError(f"{self.stage} health probe took over {HEALTH_DEADLINE_S:.0f} s") from None
        except Exception as exc:
            if injected(exc):
                return
            raise RuntimeError(f"{self.stage} health probe failed: {exc}") from exc

    async def _probe(self) -> None:
        """One tiny call through the engine (subclasses)."""
        raise NotImplementedError


class AsrReplica(_Replica):
    """Whisper behind voxpipe's batching :class:`~pipeline.asr.engine.AsrEngine`: concurrent
    calls from every session (and every front end) batch together."""

    stage: RemoteStageName = "asr"

    async def run(self, item: DecodeRequest | AsrRequest) -> DecodeResult | Transcript:
        """Decode ``item`` (see :meth:`pipeline.stages.AsrStage.run`).

        Raises:
            Busy: the engine's queue is full or its breaker is open; or the model's error.
        """
        return await self._engine().run(item)

    def _extra_stats(self, engine: Any) -> dict[str, Any]:
        return {"multilingual": bool(engine.multilingual), "languages": list(engine.languages)}

    async def _probe(self) -> None:
        await self._engine().run(DecodeRequest(np.zeros(8000, dtype=np.float32)))


class LlmReplica(_Replica):
    """voxpipe's continuous-batching :class:`~pipeline.llm.engine.LlmEngine`; replies stream
    back through a ``DeploymentResponseGenerator``."""

    stage: RemoteStageName = "llm"

    async def generate(self, req: GenRequest) -> AsyncIterator[str | GenStats]:
        """Stream ``req``'s reply: text deltas (``str``), then its :class:`GenStats` once.
        Cancelling the caller's response (or closing it) raises ``CancelledError`` here, and
        the request leaves the batch at the engine's next step.

        Raises:
            Busy: the engine's queue is full; or the engine's error, mid-stream.
        """
        stream = self._engine().submit(req)
        try:
            async for delta in stream:
                yield delta
            yield stream.stats
        finally:
            stream.abort()  # a no-op once the reply ended; frees the batch slot otherwise

    async def count_tokens(self, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> int:
        """Prompt tokens of chat ``messages`` with ``tools`` offered, under the model's template."""
        return await asyncio.to_thread(self._engine().count_tokens, messages, tools)

    def end_session(self, session: str) -> None:
        """``session`` ended: its cached KV may go."""
        self._engine().end_session(session)

    async def _probe(self) -> None:
        engine = self._engine()
        stream = engine.submit(GenRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=1,
                                          session=HEALTH_SESSION))
        try:
            async for _ in stream:
                pass
        finally:
            stream.abort()
            engine.end_session(HEALTH_SESSION)


class TtsReplica(_Replica):
    """Piper behind :class:`~pipeline.tts.engine.TtsEngine`: phrase jobs from every session."""

    stage: RemoteStageName = "tts"

    async def run(self, text: str | Phrase, priority: int | None = None) -> Speech:
        """Speak one phrase (see :meth:`pipeline.stages.TtsStage.run`).

        Raises:
            Busy: the engine's queue is full or its breaker is open; or the voice's error.
        """
        return await self._engine().run(text, priority=priority)

    async def _probe(self) -> None:
        await self._engine().run("Hi.", priority=1)


class StageDirectory:
    """The application's ingress: binds the three stage deployments into one application
    (no model, no CPU). The front end calls the stages directly by name."""

    def __init__(self, asr: DeploymentHandle, llm: DeploymentHandle, tts: DeploymentHandle) -> None:
        self._handles = {"asr": asr, "llm": llm, "tts": tts}

    def info(self) -> dict[str, list[str]]:
        """The stage deployments of this application."""
        return {"stages": sorted(self._handles)}


QUIET = {"enable_access_log": False}
"""No access-log line per call: the stats poll (every 0.5 s per stage) buried every real one."""
ASR: Deployment = serve.deployment(name="asr", user_config={}, logging_config=QUIET)(AsrReplica)
"""The ASR stage deployment (options: :mod:`pipeline.remote.settings`)."""
LLM: Deployment = serve.deployment(name="llm", user_config={}, logging_config=QUIET)(LlmReplica)
"""The LLM stage deployment."""
TTS: Deployment = serve.deployment(name="tts", user_config={}, logging_config=QUIET)(TtsReplica)
"""The TTS stage deployment."""
DIRECTORY: Deployment = serve.deployment(name=INGRESS_NAME, num_replicas=1,
                                         ray_actor_options={"num_cpus": 0})(StageDirectory)
"""The application's ingress."""
