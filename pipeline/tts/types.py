"""Messages of the TTS stage."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class Speech:
    """Synthesized audio: float32 samples in [-1, 1], shape (n,), at ``sample_rate`` Hz;
    ``synth_ms`` is the time the voice took."""

    audio: np.ndarray
    sample_rate: int
    synth_ms: float
