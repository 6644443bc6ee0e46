"""Load every model once, start the stage workers, and warm them up before ready."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, overload

import numpy as np

from audio.pcm import RATE
from audio.vad import SileroVad
from pipeline import memory_parts
from pipeline.asr.engine import AsrEngine
from pipeline.asr.loader import load_whisper, whisper_path
from pipeline.asr.types import AsrRequest
from pipeline.config import VoxpipeConfig
from pipeline.cpu_share import auto_burst_threads
from pipeline.eot.stage import EotEngine
from pipeline.llm.engine import LlmEngine
from pipeline.llm.loader import load_llm
from pipeline.llm.types import GenRequest, RemoteLlmSpec
from pipeline.model_files import ModelNotInstalled
from pipeline.serving.admission import Load
from pipeline.serving.types import StageLoad
from pipeline.stages import AsrStage, EotStage, LlmStage, Stage, TtsStage, VadModel
from pipeline.tools.toolbox import Toolbox, load_tools
from pipeline.tts.catalogue import VoiceCatalogue
from pipeline.tts.engine import PhraseEngine, TtsEngine
from pipeline.tts.loader import load_voices, piper_files

logger = logging.getLogger(__name__)


class FallbackLlm:
    """The smaller LLM that degraded turns move to (out-of-memory ladder step 3, SLO
    adaptation level 2, an LLM breaker open twice), loaded at start (:meth:`load_now`) or
    on first need in a background thread.

    Args:
        name: the model (a name :func:`~pipeline.llm.loader.load_llm` knows, or a folder).
        load: builds and starts the stage (slow; called once, off the event loop).
    """

    def __init__(self, name: str, load: Callable[[], LlmStage]) -> None:
        self.name, self._load = name, load
        self.stage: LlmStage | None = None
        self.failed: BaseException | None = None
        self._lock = threading.Lock()
        self._loading = False

    @property
    def loaded(self) -> bool:
        """Whether the stage is ready."""
        return self.stage is not None

    def get(self) -> LlmStage | None:
        """The stage if loaded; else None, and its loading starts in the background (once)."""
        if self.stage is None and self.failed is None:
            with self._lock:
                start, self._loading = not self._loading, True
            if start:
                threading.Thread(target=self._load_logged, name="voxpipe-fallback-load", daemon=True).start()
        return self.stage

    def load_now(self) -> LlmStage:
        """Load and start the stage in this thread (at start-up: ``--preload-fallback``).

        Raises:
            the loader's errors (ModelNotInstalled, ValueError, FileNotFoundError).
        """
        with self._lock:
            self._loading = True
        stage = self._load()
        stage.start()
        self.stage = stage
        return stage

    def stop(self) -> None:
        """Stop the stage, if it was loaded."""
        if self.stage is not None:
            self.stage.stop()

    def _load_logged(self) -> None:
        t0 = time.perf_counter()
        try:
            self.load_now()
        except Exception as exc:  # noqa: BLE001 - degraded turns then stay on the main model
            self.failed = exc
            logger.error("fallback LLM %s failed to load: %s", self.name, exc)
            return
        logger.info("fallback LLM %s loaded in %.1f s", self.name, time.perf_counter() - t0)


FALLBACK_OF = {"qwen1.5b": "qwen", "qwen": "smollm2"}
"""``--fallback-llm auto``: the next smaller packaged model of each (any other main model,
a local folder or a remote server, falls back to ``smollm2``; ``smollm2`` to none)."""


def fallback_model(cfg: VoxpipeConfig) -> str | None:
    """The fallback LLM ``cfg.degrade.fallback_llm`` names: ``auto`` is the next smaller
    packaged model (:data:`FALLBACK_OF`; ``smollm2`` for any other, none for ``smollm2``
    itself); ``none`` (or an empty string) is None."""
    name = cfg.degrade.fallback_llm.strip()
    if name.lower() in ("", "none"):
        return None
    if name == "auto":
        return None if cfg.llm.model == "smollm2" else FALLBACK_OF.get(cfg.llm.model, "smollm2")
    return name


@dataclass(slots=True)
class Engines:
    """The shared model stages of one process, typed by the interfaces a session uses
    (:mod:`pipeline.stages`): the in-process engines from :func:`load_engines`, fakes in
    tests, or remote stages."""

    vad: VadModel
    asr: AsrStage
    llm: LlmStage
    tts: TtsStage
    fallback_llm: FallbackLlm | None = None
    eot: EotStage | None = None
    """The end-of-turn model (None: turns end on silence alone)."""
    tools: Toolbox | None = None
    """The server's own tools (``--tools``, ``--builtin-tool``; None: none)."""
    voices: VoiceCatalogue = field(default_factory=VoiceCatalogue)
    """The TTS stage's voices, default first, that sessions pick from by name or language
    (empty: the stage does not say — fakes, a remote or Coqui stage — and speaks its own)."""
    weights: dict[str, int] = field(default_factory=dict)
    """Host memory known at load (bytes), by part of ``voxpipe_memory_bytes``: the models'
    weights (``weights_asr``, ``weights_tts``, ``weights_vad``, ``weights_eot``;
    :func:`loaded_weights`; the LLMs' come from their engines) and ``runtime`` (the
    anonymous memory before any model loaded). Empty for fakes."""

    def loads(self) -> dict[str, StageLoad]:
        """Each stage's load snapshot, by stage name (``asr``, ``llm``, ``tts``, and ``eot``
        when the end-of-turn model is loaded)."""
        out = {"asr": self.asr.load(), "llm": self.llm.load(), "tts": self.tts.load()}
        if self.eot is not None:
            out["eot"] = self.eot.load()
        return out

    def end_session(self, session: str) -> None:
        """``session`` ended: the LLMs may release its cached KV."""
        self.llm.end_session(session)
        if self.fallback_llm is not None and self.fallback_llm.stage is not None:
            self.fallback_llm.stage.end_session(session)

    def load(self, cfg: VoxpipeConfig) -> Load:
        """A snapshot of the stages' queues for admission (:mod:`pipeline.serving.admission`)."""
        return Load.of(self.asr.load(), self.llm.load(), self.tts.load(), asr_batch=cfg.asr.max_batch_size,
                       tts_workers=cfg.tts.workers)

    def stages(self) -> list[Stage]:
        """The model stages this process starts and stops: ASR, LLM, TTS and the end-of-turn
        model when loaded (not the fallback LLM: it starts when it loads)."""
        out: list[Stage] = [self.asr, self.llm, self.tts]
        if self.eot is not None:
            out.append(self.eot)
        return out

    def start(self) -> None:
        """Start every stage's workers."""
        for stage in self.stages():
            stage.start()

    def stop(self) -> None:
        """Stop every stage's workers."""
        for stage in self.stages():
            stage.stop()
        if self.fallback_llm is not None:
            self.fallback_llm.stop()
        if self.tools is not None:
            self.tools.close()


@overload
def load_stage(cfg: VoxpipeConfig, stage: Literal["asr"]) -> AsrEngine: ...
@overload
def load_stage(cfg: VoxpipeConfig, stage: Literal["llm"]) -> LlmEngine: ...
@overload
def load_stage(cfg: VoxpipeConfig, stage: Literal["tts"]) -> PhraseEngine: ...
def load_stage(cfg: VoxpipeConfig, stage: Literal["asr", "llm", "tts"]) -> AsrEngine | LlmEngine | PhraseEngine:
    """Load one model stage's engine (not started): what :func:`load_engines` does for each,
    and what a Ray Serve replica runs (:mod:`pipeline.remote.replicas`). Slow: call off the
    event loop.

    Raises:
        ModelNotInstalled, ValueError, FileNotFoundError: see the loaders (and
            :func:`open_tools`).
    """
    if stage == "asr":
        return AsrEngine(load_whisper(cfg.asr), cfg.asr)
    if stage == "llm":
        return LlmEngine(load_llm(cfg.llm.model, device=cfg.llm.device, threads=cfg.llm.threads), cfg.llm,
                         cfg.llm_batch)
    if stage == "tts" and cfg.tts.backend == "coqui":
        from pipeline.tts.coqui import load_coqui_engine

        return load_coqui_engine(cfg.tts)
    if stage == "tts":
        return TtsEngine(load_voices(cfg.tts), cfg.tts)
    raise ValueError(f"unknown stage {stage!r}: asr, llm or tts")


def load_eot(cfg: VoxpipeConfig) -> EotEngine | None:
    """The end-of-turn stage (not started) when ``cfg.turn.end_of_turn`` is ``smart-turn``;
    else None. The default model (``eot_model`` ``auto``) not installed is logged as a warning
    and gives None: turns then end on silence, as before the model existed (a model named by
    path must load). Slow-ish: call off the event loop.

    Raises:
        ModelNotInstalled, FileNotFoundError, ValueError: see :func:`~pipeline.eot.loader.load_eot_model`.
    """
    if cfg.turn.end_of_turn != "smart-turn":
        return None
    try:
        eot = EotEngine.from_config(cfg.turn)
    except ModelNotInstalled as exc:
        if cfg.turn.eot_model != "auto":
            raise
        logger.warning("end of turn: %s; turns end after %d ms of silence instead", exc, cfg.turn.end_silence_ms)
        return None
    logger.info("end-of-turn model loaded (%s, %d thread(s), batches of %d)", eot.model.info.path.name,
                cfg.turn.eot_threads, cfg.turn.eot_batch_size)
    return eot


def open_tools(cfg: VoxpipeConfig) -> Toolbox | None:
    """The server's tools (``--tools``, ``--builtin-tool``), or None when none is configured.

    Raises:
        ValueError: see :func:`~pipeline.tools.toolbox.load_tools`.
    """
    if not cfg.tools.enabled:
        return None
    toolbox = load_tools(cfg.tools.plugin, cfg.tools.builtin, timeout_s=cfg.tools.timeout_s)
    logger.info("tools: %s", ", ".join(s.name for s in toolbox.specs))
    return toolbox


def loaded_weights(cfg: VoxpipeConfig, engines: Engines) -> dict[str, int]:
    """The weights (bytes) the loaders know for :attr:`Engines.weights`: model files'
    sizes for onnxruntime and CTranslate2 models (:mod:`pipeline.memory_parts` says which
    are estimates), a Coqui voice's tensors; a stage not in host memory (Whisper on CUDA, a
    remote or fake stage) counts 0. Cheap: file sizes, no model read."""
    from pipeline import model_files

    out = {"weights_vad": memory_parts.file_bytes([model_files.silero_vad_path()])}
    if isinstance(engines.asr, AsrEngine) and engines.asr.model.model.device == "cpu":
        out["weights_asr"] = memory_parts.file_bytes([whisper_path(cfg.asr.model) / "model.bin"])
    tts_model = getattr(engines.tts, "model", None)  # a Coqui engine's torch module
    if cfg.tts.backend == "coqui" and tts_model is not None:  # one model, however many speakers
        out["weights_tts"] = memory_parts.tensor_bytes(tts_model)
    elif isinstance(engines.tts, TtsEngine):
        out["weights_tts"] = memory_parts.file_bytes(piper_files(cfg.tts))
    if isinstance(engines.eot, EotEngine):
        out["weights_eot"] = memory_parts.file_bytes([engines.eot.model.info.path])
    return out


def load_engines(cfg: VoxpipeConfig) -> Engines:
    """Load VAD, Whisper, the LLM, the voices (``--voice``) and, with ``--end-of-turn smart-turn``,
    the end-of-turn model (slow: call once at startup).

    Raises:
        ModelNotInstalled, ValueError, FileNotFoundError: see the loaders.
        RemoteLlmUnavailable: ``--llm openai:URL``'s server cannot be used (checked first).
    """
    from pipeline import model_files

    cfg.validate()
    if cfg.llm.burst_threads is None:  # auto: every stage runs in this process (LlmConfig.burst_threads)
        cfg = replace(cfg, llm=replace(cfg.llm, burst_threads=auto_burst_threads()))
    t0 = time.perf_counter()
    runtime = memory_parts.anonymous_rss()  # the interpreter and the libraries imported so far
    tools = open_tools(cfg)  # a plugin that does not import fails before any model loads
    remote_llm: LlmStage | None = None
    if RemoteLlmSpec.is_remote(cfg.llm.model):  # a remote server is checked before any model loads
        from pipeline.llm.remote import open_remote_llm

        remote_llm = open_remote_llm(cfg)
    vad = SileroVad(model_files.silero_vad_path(), gate=cfg.turn.vad_gate)
    tts = load_stage(cfg, "tts")  # first: a mistyped --voice fails in a second, not after the LLM
    asr = load_stage(cfg, "asr")
    logger.info("ASR loaded (%s)", cfg.asr.model)
    llm = remote_llm if remote_llm is not None else load_stage(cfg, "llm")
    logger.info("LLM loaded (%s)", cfg.llm.model)
    eot = load_eot(cfg)
    fallback = None
    name = fallback_model(cfg)
    if name is not None:
        fallback = FallbackLlm(name, lambda: LlmEngine(load_llm(name, device=cfg.llm.device, threads=cfg.llm.threads),
                                                       cfg.llm, cfg.llm_batch))
        if cfg.degrade.preload_fallback:
            fallback.load_now()
            logger.info("fallback LLM loaded (%s)", name)
    logger.info("models loaded in %.1f s", time.perf_counter() - t0)
    voices = tts.catalogue if isinstance(tts, TtsEngine) else VoiceCatalogue()
    if voices.voices:
        logger.info("voices: %s (default %s)", voices.names(), voices.voices[0].name)
    engines = Engines(vad=vad, asr=asr, llm=llm, tts=tts, fallback_llm=fallback, eot=eot, tools=tools,
                      voices=voices)
    engines.weights = {"runtime": runtime, **loaded_weights(cfg, engines)}
    engines.start()
    return engines


async def warm_up(engines: Engines) -> dict[str, float]:
    """Run one ASR, LLM, TTS (and end-of-turn) call so the first user does not pay for lazy
    initialisation (the server is ready only after it: tests/test_startup.py). Returns each
    stage's warm-up time (ms)."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    await engines.asr.run(AsrRequest(np.zeros(RATE, dtype=np.float32)))
    out["asr"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    stream = engines.llm.submit(GenRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=4,
                                           session="warm-up"))
    async for _ in stream:
        pass
    engines.end_session("warm-up")  # its cached KV goes
    out["llm"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    await engines.tts.run("Hello.")
    out["tts"] = (time.perf_counter() - t) * 1000
    if engines.eot is not None:
        t = time.perf_counter()
        await engines.eot.run(np.zeros(RATE, dtype=np.float32))
        out["eot"] = (time.perf_counter() - t) * 1000
    if engines.fallback_llm is not None and engines.fallback_llm.stage is not None:
        t = time.perf_counter()
        stream = engines.fallback_llm.stage.submit(GenRequest(messages=[{"role": "user", "content": "Hi"}],
                                                              max_new_tokens=4))
        async for _ in stream:
            pass
        out["fallback_llm"] = (time.perf_counter() - t) * 1000
    logger.info("warm-up (ms): %s", {k: round(v) for k, v in out.items()})
    return out
