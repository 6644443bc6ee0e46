"""Microphone capture and speaker playback for the CLI (sounddevice / PortAudio).

Importing this module does not touch audio hardware; :func:`open_devices` does.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np


class DeviceError(RuntimeError):
    """No usable audio device (or PortAudio is not installed)."""


def _sd():
    try:
        import sounddevice
    except OSError as exc:  # libportaudio2 missing
        raise DeviceError(f"PortAudio not available ({exc}); install libportaudio2") from None
    return sounddevice


class Player:
    """Gap-free playback of PCM16 chunks pushed from any thread.

    Args:
        sample_rate: output rate (Hz).
        device: sounddevice output device (name or index), None for the default.

    Raises:
        DeviceError: no output device (or PortAudio is missing).
    """

    def __init__(self, sample_rate: int, device=None) -> None:
        self._buf: collections.deque[np.ndarray] = collections.deque()
        self._lock = threading.Lock()
        sd = _sd()
        try:
            self._stream = sd.OutputStream(samplerate=sample_rate, channels=1, dtype="int16",
                                           device=device, callback=self._callback)
        except Exception as exc:  # noqa: BLE001 - PortAudioError and friends
            raise DeviceError(f"cannot open the speaker: {exc}") from None

    def start(self) -> None:
        self._stream.start()

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()

    def push(self, pcm16: bytes) -> None:
        """Queue PCM16 mono bytes for playback."""
        with self._lock:
            self._buf.append(np.frombuffer(pcm16, dtype="<i2"))

    def flush(self) -> None:
        """Drop everything not yet played (barge-in, cancel)."""
        with self._lock:
            self._buf.clear()

    def _callback(self, out, frames, _time, _status) -> None:
        filled = 0
        with self._lock:
            while filled < frames and self._buf:
                chunk = self._buf[0]
                n = min(frames - filled, len(chunk))
                out[filled : filled + n, 0] = chunk[:n]
                filled += n
                if n == len(chunk):
                    self._buf.popleft()
                else:
                    self._buf[0] = chunk[n:]
        out[filled:, 0] = 0


def open_microphone(sample_rate: int, on_pcm16: Callable[[bytes], None], device=None):
    """Start capturing 16-bit mono audio; ``on_pcm16(bytes)`` is called from the audio
    thread every 20 ms. Returns the started ``sounddevice.InputStream``.

    Raises:
        DeviceError: no input device.
    """
    sd = _sd()
    try:
        stream = sd.InputStream(samplerate=sample_rate, channels=1, dtype="int16", device=device,
                                blocksize=sample_rate // 50, callback=lambda d, *_: on_pcm16(bytes(d)))
        stream.start()
    except Exception as exc:  # noqa: BLE001 - PortAudioError and friends
        raise DeviceError(f"cannot open the microphone: {exc}") from None
    return stream
