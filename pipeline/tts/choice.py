"""The ``--tts`` flag: which TTS backend speaks, checked at start-up before any model loads."""

from __future__ import annotations

import dataclasses

from pipeline.config import TtsConfig


def resolve_tts(cfg: TtsConfig) -> TtsConfig:
    """``cfg`` with its ``backend`` as ``--tts`` gives it — ``piper``, ``piper:VOICE`` (an alias
    of ``--voice``) or ``coqui:PATH`` — split into ``backend`` and ``voice``. A Coqui folder is
    checked here (:func:`pipeline.tts.coqui.check_model_folder`; nothing is imported or loaded).

    Raises:
        ValueError: one line: an unknown backend, a missing path, both ``--voice`` and
            ``piper:VOICE``, ``--voice`` with Coqui, coqui-tts not installed, or a missing
            or unsupported Coqui folder.
    """
    spec, voice = cfg.backend, cfg.voice
    default_voice = TtsConfig().voice
    backend, sep, arg = spec.strip().partition(":")
    backend = backend.lower()
    if backend == "piper":
        if sep and voice != default_voice and arg != voice:
            raise ValueError(f"--tts {spec!r} and --voice {voice!r}: give the Piper voice once")
        return dataclasses.replace(cfg, backend="piper", voice=arg if sep else voice)
    if backend == "coqui":
        if not arg:
            raise ValueError("--tts coqui needs the model folder: --tts coqui:/path/to/model")
        if voice != default_voice:
            raise ValueError("--voice chooses a Piper voice; with --tts coqui:PATH the folder is the voice")
        from pipeline.tts.coqui import check_coqui_installed, check_model_folder

        check_coqui_installed()
        check_model_folder(arg)
        return dataclasses.replace(cfg, backend="coqui", voice=arg)
    raise ValueError(f"--tts {spec!r}: use piper, piper:VOICE or coqui:PATH")
