"""The ``--tts`` and ``--voice`` flags: which TTS backend and voices speak, checked at start-up
before any model loads."""

from __future__ import annotations

import dataclasses
import logging
import shutil

from pipeline.config import AsrConfig, TtsConfig, VoxpipeConfig
from pipeline.tts.catalogue import language_code, parse_voices

logger = logging.getLogger(__name__)

MULTILINGUAL_ASR = "base"
"""The Whisper model a server with a non-English voice uses when ``--asr-model`` is left at
its English-only default."""


def resolve_tts(cfg: TtsConfig) -> TtsConfig:
    """``cfg`` with its ``backend`` as ``--tts`` gives it — ``piper``, ``piper:VOICE`` (an alias
    of one ``--voice``) or ``coqui:PATH`` — split into ``backend`` and ``voices``. Piper's
    ``--voice`` entries are parsed (:func:`pipeline.tts.catalogue.parse_voices`) and an
    ``espeak:CODE`` voice needs the espeak-ng program; a Coqui folder is checked here
    (:func:`pipeline.tts.coqui_folder.check_model_folder`; nothing is imported or loaded).

    Raises:
        ValueError: one line: an unknown backend, a missing path, both ``--voice`` and
            ``piper:VOICE``, ``--voice`` with Coqui, a bad ``--voice`` entry, espeak-ng not
            installed, coqui-tts not installed, or a missing or unsupported Coqui folder.
    """
    spec, voices = cfg.backend, cfg.voices
    backend, sep, arg = spec.strip().partition(":")
    backend = backend.lower()
    if backend == "piper":
        if sep and voices and voices != (arg,):
            raise ValueError(f"--tts {spec!r} and --voice {', '.join(voices)}: give the Piper voice once")
        cfg = dataclasses.replace(cfg, backend="piper", voices=(arg,) if sep else voices)
        specs = parse_voices(cfg.voices)
        if any(s.backend == "espeak" for s in specs) and shutil.which("espeak-ng") is None:
            raise ValueError("--voice espeak:CODE needs the espeak-ng program: apt-get install espeak-ng")
        return cfg
    if backend == "coqui":
        if not arg:
            raise ValueError("--tts coqui needs the model folder: --tts coqui:/path/to/model")
        if voices:
            raise ValueError("--voice chooses Piper voices; with --tts coqui:PATH the model's speakers are "
                             "the voices (GET /v1/voices; a session picks one with its voice field)")
        from pipeline.tts.coqui_folder import check_coqui_installed, check_model_folder

        check_coqui_installed()
        check_model_folder(arg)
        return dataclasses.replace(cfg, backend="coqui", voices=(arg,))
    raise ValueError(f"--tts {spec!r}: use piper, piper:VOICE or coqui:PATH")


def voice_languages(cfg: TtsConfig) -> list[str]:
    """The languages of the configured voices (ISO 639-1, default first; Coqui: a
    multilingual model's languages, else English).

    Raises:
        ValueError: a bad ``--voice`` entry or Coqui folder.
    """
    if cfg.backend == "coqui":
        from pipeline.tts.coqui_folder import check_model_folder

        return [language_code(lang) for lang in check_model_folder(cfg.voice).languages] or ["en"]
    if cfg.backend != "piper":
        return ["en"]
    return [s.language for s in parse_voices(cfg.voices)]


def multilingual_asr(cfg: VoxpipeConfig, *, asr_model_given: bool) -> VoxpipeConfig:
    """``cfg`` with Whisper ``base`` (multilingual, detects the language) when a voice speaks
    another language than English and ``--asr-model`` was not given (``asr_model_given``) and
    is the English-only default — logged, so the start-up log says why; else ``cfg`` as is.

    Raises:
        ValueError: a bad ``--voice`` entry.
    """
    others = [lang for lang in voice_languages(cfg.tts) if lang != "en"]
    if others and cfg.asr.model.endswith(".en") and (asr_model_given or cfg.asr.model != AsrConfig().model):
        logger.warning("a %s voice is configured but the ASR %r is English-only: it never detects another "
                       "language, so that voice speaks only for sessions that choose it (session.start voice)",
                       "/".join(others), cfg.asr.model)
    if not others or asr_model_given or cfg.asr.model != AsrConfig().model:
        return cfg
    logger.info("a %s voice is configured: ASR uses the multilingual Whisper %r instead of %r "
                "(--asr-model overrides)", "/".join(others), MULTILINGUAL_ASR, cfg.asr.model)
    return dataclasses.replace(cfg, asr=dataclasses.replace(cfg.asr, model=MULTILINGUAL_ASR))
