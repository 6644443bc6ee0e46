"""Smart Turn v3.2's input: Whisper log-mel features of the turn's last 8 s.

The recipe is pipecat's (``pipecat/audio/turn/smart_turn/local_smart_turn_v3.py``,
``_predict_endpoint``, pipecat-ai 1.14.0, BSD-2-Clause), which is
``transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=8)`` with
``do_normalize=True`` on audio already cut or padded to 8 s:

1. keep the last 8 s of 16 kHz audio; pad a shorter turn with zeros at the FRONT to
   128 000 samples (the speech stays at the end, where the model looks for the turn's end);
2. normalise the whole 8 s window to zero mean and unit variance,
   ``(x - mean) / sqrt(var + 1e-7)`` (transformers' ``zero_mean_unit_var_norm``);
3. Whisper's log-mel spectrogram (400-point FFT, hop 160, 80 Slaney mels, log10 clamped to
   8 below its maximum, ``(x + 4) / 4``), here faster-whisper's numpy
   :class:`faster_whisper.feature_extractor.FeatureExtractor` (no padding): 800 frames.

``tests/test_eot.py`` pins this against transformers' extractor.
"""

from __future__ import annotations

import numpy as np
from faster_whisper.feature_extractor import FeatureExtractor

SAMPLE_RATE = 16_000
"""The model's sample rate (Hz)."""
WINDOW_S = 8
"""Seconds of audio the model sees: the turn's last 8 s."""
WINDOW = SAMPLE_RATE * WINDOW_S
"""Samples the model sees (128 000)."""
N_MELS = 80
"""Mel bands per frame."""
N_FRAMES = 800
"""Frames per window (10 ms hop)."""
NORM_EPS = 1e-7
"""Variance floor of the waveform normalisation (transformers' ``zero_mean_unit_var_norm``)."""

_EXTRACTOR = FeatureExtractor(feature_size=N_MELS, chunk_length=WINDOW_S)  # stateless when called without chunk_length


def turn_window(audio: np.ndarray) -> np.ndarray:
    """The model's window of a turn: its last :data:`WINDOW` samples, a shorter turn padded
    with zeros at the front.

    Args:
        audio: the turn's 16 kHz mono samples, shape (n,), any float or int dtype
            (ints are taken as they are: pass floats in [-1, 1]).

    Returns:
        float32, shape (128000,), a new array.

    Raises:
        ValueError: ``audio`` is not one-dimensional.
    """
    if audio.ndim != 1:
        raise ValueError(f"end-of-turn audio must be one-dimensional, got shape {audio.shape}")
    tail = np.asarray(audio[-WINDOW:], dtype=np.float32)
    out = np.zeros(WINDOW, dtype=np.float32)
    if len(tail):
        out[-len(tail):] = tail
    return out


def features(audio: np.ndarray) -> np.ndarray:
    """Smart Turn's input features of one turn (the module's recipe).

    Args:
        audio: the turn's 16 kHz mono samples, shape (n,), float in [-1, 1]; any length
            (the last 8 s are used; empty: silence).

    Returns:
        float32, shape (80, 800): ``(log10(mel power) + 4) / 4``, each value at most 2 below
        the window's maximum.

    Raises:
        ValueError: ``audio`` is not one-dimensional.
    """
    x = turn_window(audio)
    x = (x - x.mean()) / np.sqrt(x.var() + NORM_EPS)
    return np.asarray(_EXTRACTOR(x, padding=0)[:, :N_FRAMES], dtype=np.float32)


def batch_features(audios: list[np.ndarray]) -> np.ndarray:
    """:func:`features` of each turn, stacked: float32, shape (len(audios), 80, 800).

    Raises:
        ValueError: an audio is not one-dimensional.
    """
    return np.stack([features(a) for a in audios])
