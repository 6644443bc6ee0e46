"""Load every model once, start the stage workers, and warm them up before ready."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from audio.vad import SileroVad
from pipeline.asr.engine import AsrEngine
from pipeline.asr.loader import load_whisper
from pipeline.asr.types import AsrRequest
from pipeline.config import VoxpipeConfig
from pipeline.llm.engine import LlmEngine
from pipeline.llm.loader import load_llm
from pipeline.llm.types import GenRequest
from pipeline.serving.admission import Load
from pipeline.stages import AsrStage, LlmStage, Stage, TtsStage, VadModel
from pipeline.tts.engine import TtsEngine
from pipeline.tts.loader import load_voice

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Engines:
    """The shared model stages of one process, typed by the interfaces a session uses
    (:mod:`pipeline.stages`): the in-process engines from :func:`load_engines`, fakes in
    tests, or remote stages."""

    vad: VadModel
    asr: AsrStage
    llm: LlmStage
    tts: TtsStage

    def queue_depths(self) -> dict[str, int]:
        """Waiting requests per stage."""
        return {"asr": self.asr.depth, "llm": self.llm.depth, "tts": self.tts.depth}

    def load(self, cfg: VoxpipeConfig) -> Load:
        """A snapshot of the stages' queues for admission (:mod:`pipeline.serving.admission`)."""
        llm = self.llm
        # partial transcripts and later phrases wait behind urgent work: they don't delay a turn
        return Load(asr_waiting=self.asr.urgent_depth, asr_batch=cfg.asr.max_batch_size, llm_waiting=llm.depth,
                    llm_running=llm.active, llm_slots=llm.slots, kv_reserved=llm.kv_reserved,
                    kv_budget=llm.kv_budget, llm_step_ms=llm.step_ms, tts_waiting=self.tts.urgent_depth,
                    tts_workers=cfg.tts.workers)

    def start(self) -> None:
        """Start every stage's workers."""
        stages: tuple[Stage, ...] = (self.asr, self.llm, self.tts)
        for stage in stages:
            stage.start()

    def stop(self) -> None:
        """Stop every stage's workers."""
        stages: tuple[Stage, ...] = (self.asr, self.llm, self.tts)
        for stage in stages:
            stage.stop()


def load_engines(cfg: VoxpipeConfig) -> Engines:
    """Load VAD, Whisper, the LLM and the Piper voice (slow: call once at startup).

    Raises:
        ModelNotInstalled, ValueError, FileNotFoundError: see the loaders.
    """
    from pipeline import model_files

    cfg.validate()
    t0 = time.perf_counter()
    vad = SileroVad(model_files.silero_vad_path())
    asr = AsrEngine(load_whisper(cfg.asr), cfg.asr)
    logger.info("ASR loaded (%s)", cfg.asr.model)
    llm = LlmEngine(load_llm(cfg.llm.model, device=cfg.llm.device, threads=cfg.llm.threads), cfg.llm, cfg.llm_batch)
    logger.info("LLM loaded (%s)", cfg.llm.model)
    tts = TtsEngine(load_voice(cfg.tts), cfg.tts)
    logger.info("models loaded in %.1f s", time.perf_counter() - t0)
    engines = Engines(vad=vad, asr=asr, llm=llm, tts=tts)
    engines.start()
    return engines


async def warm_up(engines: Engines) -> dict[str, float]:
    """Run one ASR, LLM and TTS call so the first user does not pay for lazy
    initialisation (CASES.md C17). Returns each stage's warm-up time (ms)."""
    out: dict[str, float] = {}
    t = time.perf_counter()
    await engines.asr.run(AsrRequest(np.zeros(16000, dtype=np.float32)))
    out["asr"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    stream = engines.llm.submit(GenRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=4))
    async for _ in stream:
        pass
    out["llm"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    await engines.tts.run("Hello.")
    out["tts"] = (time.perf_counter() - t) * 1000
    logger.info("warm-up (ms): %s", {k: round(v) for k, v in out.items()})
    return out
