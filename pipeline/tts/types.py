"""Messages of the TTS stage."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VoiceBackend = str
"""How a voice speaks: ``piper`` (an onnxruntime Piper model), ``espeak`` (the ``espeak-ng``
program) or ``coqui`` (a Coqui TTS model folder)."""


@dataclass(slots=True)
class Speech:
    """Synthesized audio: float32 samples in [-1, 1], shape (n,), at ``sample_rate`` Hz;
    ``synth_ms`` is the time the voice took; ``voice`` the name of the voice that spoke
    (empty where the stage does not say)."""

    audio: np.ndarray
    sample_rate: int
    synth_ms: float
    voice: str = ""


@dataclass(frozen=True, slots=True)
class Phrase:
    """A TTS job: ``text`` to speak with the voice named ``voice`` (None: the stage's default
    voice). A plain ``str`` job is the same as ``Phrase(text)``."""

    text: str
    voice: str | None = None


@dataclass(frozen=True, slots=True)
class VoiceSpec:
    """One ``--voice`` entry, parsed (:func:`pipeline.tts.catalogue.parse_voice`), not loaded.

    ``name``: what sessions call it (``joe``, the ``.onnx`` file's stem, ``espeak-LANG``);
    ``language``: the ISO 639-1 code it speaks (``en``, ``de``); ``backend``: see
    :data:`VoiceBackend`; ``source``: ``joe``, the ``.onnx`` path, the espeak-ng voice code, or
    the Coqui folder."""

    name: str
    language: str
    backend: VoiceBackend
    source: str


@dataclass(frozen=True, slots=True)
class VoiceInfo:
    """A loaded voice as clients see it (``GET /v1/voices``): ``name``, ``language`` (ISO
    639-1), ``backend`` and its output ``sample_rate`` (Hz)."""

    name: str
    language: str
    backend: VoiceBackend
    sample_rate: int

    def as_json(self) -> dict[str, str | int]:
        """``{"name", "language", "backend", "sample_rate"}``."""
        return {"name": self.name, "language": self.language, "backend": self.backend,
                "sample_rate": self.sample_rate}
