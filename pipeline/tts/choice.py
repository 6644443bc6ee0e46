"""The ``--tts`` flag: which TTS backend speaks, checked at start-up before any model loads."""

from __future__ import annotations

from pipeline.config import TtsConfig

TTS_FLAG_HELP = ("piper (default: the --voice voice), piper:VOICE (joe or a Piper .onnx), or coqui:PATH (a Coqui "
                 "TTS model folder: config.json + checkpoint; VITS, one speaker; needs the coqui extra)")


def tts_config(flag: str, *, voice: str = "joe", threads: int = 1) -> TtsConfig:
    """The :class:`TtsConfig` for ``--tts FLAG`` (with ``--voice VOICE``): ``piper``,
    ``piper:VOICE`` (an alias of ``--voice``) or ``coqui:PATH``. A Coqui folder is checked
    here (:func:`pipeline.tts.coqui_folder.check_model_folder`; nothing is imported or loaded).

    Raises:
        ValueError: one line: an unknown backend, a missing path, both ``--voice`` and
            ``piper:VOICE``, ``--voice`` with Coqui, coqui-tts not installed, or a missing
            or unsupported Coqui folder.
    """
    backend, sep, arg = flag.strip().partition(":")
    backend = backend.lower()
    if backend == "piper":
        if sep and voice != "joe" and arg != voice:
            raise ValueError(f"--tts {flag!r} and --voice {voice!r}: give the Piper voice once")
        return TtsConfig(backend="piper", voice=arg if sep else voice, threads=threads)
    if backend == "coqui":
        if not arg:
            raise ValueError("--tts coqui needs the model folder: --tts coqui:/path/to/model")
        if voice != "joe":
            raise ValueError("--voice chooses a Piper voice; with --tts coqui:PATH the folder is the voice")
        from pipeline.tts.coqui_folder import check_coqui_installed, check_model_folder

        check_coqui_installed()
        check_model_folder(arg)
        return TtsConfig(backend="coqui", voice=arg, threads=threads)
    raise ValueError(f"--tts {flag!r}: use piper, piper:VOICE or coqui:PATH")
