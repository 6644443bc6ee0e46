"""G.711 μ-law, the telephone network's 8 kHz audio (Twilio Media Streams' ``audio/x-mulaw``),
through FFmpeg's ``pcm_mulaw`` codec (PyAV): μ-law bytes ↔ little-endian PCM16 bytes.

Each byte is one sample (ITU-T G.711); the codec holds no state between calls, and a call
costs tens of microseconds for 20 ms of audio, so it runs on the event loop.
"""

from __future__ import annotations

import av
import numpy as np

MULAW_RATE = 8000
"""G.711's sample rate (Hz)."""


class MulawCodec:
    """μ-law ↔ PCM16 at :data:`MULAW_RATE`, mono."""

    def __init__(self) -> None:
        self._dec = av.CodecContext.create("pcm_mulaw", "r")
        self._dec.sample_rate, self._dec.layout = MULAW_RATE, "mono"
        enc = av.CodecContext.create("pcm_mulaw", "w")
        enc.sample_rate, enc.layout, enc.format = MULAW_RATE, "mono", "s16"
        enc.open()
        self._enc = enc
        self._pts = 0
        self._odd = b""  # a byte of a sample split between two encode calls

    def decode(self, mulaw: bytes) -> bytes:
        """μ-law bytes (one per sample) → PCM16 little-endian bytes (two per sample)."""
        if not mulaw:
            return b""
        frames = self._dec.decode(av.Packet(mulaw))
        return b"".join(f.to_ndarray().astype("<i2").tobytes() for f in frames)

    def encode(self, pcm16: bytes) -> bytes:
        """PCM16 little-endian bytes → μ-law bytes (a trailing odd byte waits for the next call)."""
        data = self._odd + bytes(pcm16)
        even = len(data) - len(data) % 2
        self._odd = data[even:]
        if even == 0:
            return b""
        x = np.frombuffer(data[:even], dtype="<i2")
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, :]), format="s16", layout="mono")
        frame.sample_rate, frame.pts = MULAW_RATE, self._pts
        self._pts += len(x)
        return b"".join(bytes(p) for p in self._enc.encode(frame))
