"""Load a Coqui TTS model folder the way Coqui's own ``Synthesizer._load_tts`` does
(``load_config`` → ``setup_model`` → ``load_checkpoint(eval=True)``), on the CPU; never
downloads. torch and coqui-tts are imported here only, inside the functions that need them
(the folder check, :mod:`pipeline.tts.coqui_folder`, and the engine, :mod:`pipeline.tts.coqui`,
import neither)."""

from __future__ import annotations

import importlib
import importlib.machinery
import logging
import sys
import types
from pathlib import Path

from pipeline.tts.coqui_folder import NAME_FILES, check_model_folder, name_file

logger = logging.getLogger(__name__)


def import_coqui() -> None:
    """Import coqui-tts (``TTS``) for VITS inference.

    Coqui imports torchaudio at module level and, with torch >= 2.9, requires torchcodec to be
    installed, yet VITS inference calls neither (they serve training, audio files and
    resampling to a speaker encoder's rate). Their only Linux wheels on PyPI are CUDA builds
    whose C libraries cannot load beside a CPU-only torch — and, once installed, they break
    other libraries that import them when present (``transformers.audio_utils``). So the
    ``coqui`` extra installs neither, and each one that cannot be imported is stood in for by
    an empty module whose every attribute raises :class:`AttributeError` naming the missing
    package. A working torchaudio or torchcodec is used as is.

    Raises:
        ImportError: coqui-tts (or torch) is not installed.
    """
    for name in _COQUI_EAGER_IMPORTS:
        if not _importable(name):
            sys.modules[name] = _absent(name)
            logger.info("%s cannot be imported: Coqui gets a stand-in (VITS inference does not use it)", name)
    import TTS  # noqa: F401


_COQUI_EAGER_IMPORTS = ("torchaudio", "torchcodec")


def _importable(name: str) -> bool:
    if isinstance(sys.modules.get(name), _Absent):
        return False
    try:
        importlib.import_module(name)
    except (ImportError, OSError):  # not installed, or a C library that cannot load
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]  # what a failed import left half-initialised
        return False
    return True


class _Absent(types.ModuleType):
    """A package that is not there: importable by name, every attribute an error."""

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        raise AttributeError(f"{self.__name__}.{attr}: {self.__name__} is not installed (or cannot load); "
                             "voxpipe's Coqui backend does not use it")


def _absent(name: str) -> types.ModuleType:
    mod = _Absent(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return mod


def load_coqui(path: str | Path):
    """Load the model of a Coqui folder (see :func:`check_model_folder`) on the CPU, in eval mode.

    A speakers or language-ids file the config names is read from the folder when the named
    path is relative or elsewhere (:func:`~pipeline.tts.coqui_folder.name_file`).

    Returns:
        the Coqui model (e.g. ``TTS.tts.models.vits.Vits``) and its output rate (Hz: the config's
        ``audio.output_sample_rate``, else ``audio.sample_rate``, as Coqui's Synthesizer reads it).

    Raises:
        ValueError: the folder is missing or unsupported (:func:`check_model_folder`).
        ImportError: coqui-tts is not installed.
    """
    folder = check_model_folder(path)
    import_coqui()
    from TTS.config import load_config
    from TTS.tts.models import setup_model

    config = load_config(str(folder.config))
    for section in (config, config.model_args):
        for key in NAME_FILES:
            if isinstance(section.get(key), str) and section.get(key):
                section[key] = str(name_file(folder.config.parent, section[key]))
    model = setup_model(config=config)
    model.load_checkpoint(config, checkpoint_path=str(folder.checkpoint), eval=True)
    rate = int(config.audio.get("output_sample_rate", config.audio["sample_rate"]))
    logger.info("Coqui %s loaded from %s (%d Hz)", folder.kind, folder.checkpoint, rate)
    return model, rate


def use_threads(n: int) -> None:
    """Give the calling thread ``n`` torch intra-op threads. Under OpenMP the count belongs to
    each thread once it has run an op, so a TTS worker sets it for itself, leaving the LLM's
    own budget alone."""
    import torch

    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
