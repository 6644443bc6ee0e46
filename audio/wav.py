"""WAV file I/O through soundfile (libsndfile)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf


def read_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file as float32.

    Returns:
        (samples, sample_rate): samples has shape (n,) for mono or (n, channels).
    Raises:
        soundfile.LibsndfileError: unreadable or unsupported file.
    """
    data, rate = sf.read(str(path), dtype="float32", always_2d=False)
    return data, int(rate)


def read_mono(path: str | Path) -> tuple[np.ndarray, int]:
    """Read an audio file, downmixed to mono float32, shape (n,)."""
    data, rate = read_audio(path)
    if data.ndim == 2:
        data = data.mean(axis=1)
    return np.ascontiguousarray(data, dtype=np.float32), rate


def write_wav(path: str | Path, samples: np.ndarray, sample_rate: int) -> None:
    """Write mono samples (float32 in [-1, 1] or int16) as a 16-bit PCM WAV file."""
    arr = np.asarray(samples)
    if arr.dtype != np.int16:
        arr = np.rint(np.clip(arr, -1.0, 1.0) * 32767.0).astype(np.int16)
    sf.write(str(path), arr, sample_rate, subtype="PCM_16")
