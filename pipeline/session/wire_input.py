"""The session's input stream as ``session.start`` declared it: wire frames → 16 kHz samples.

Two kinds, one interface (:class:`WireInput`):

- :class:`PcmInput` — PCM16 or float32 bytes, any length per frame (:class:`PcmDecoder`),
  held in 80 ms batches while the stream is quiet (:class:`QuietBatcher`); decoded on the
  event loop (a numpy cast and soxr: microseconds per frame).
- :class:`OpusInput` — one Opus packet per frame (:mod:`audio.opus`), held four packets at a
  time while quiet, decoded on the codec pool (off the event loop). A corrupt packet loses
  its own audio only: the client hears of it (``bad_audio``) and the stream goes on, as a
  packet lost on the network would.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from audio.opus import OpusDecoder, packet_seconds, run_codec
from audio.pcm import AudioFormatError, PcmDecoder, PcmFormat
from pipeline.session.quiet_batch import QUIET_BATCH_MS, QuietBatcher

QUIET_PACKETS = 4
"""Opus packets held while the stream is quiet (four 20 ms packets: :data:`QUIET_BATCH_MS`)."""


class WireInput(Protocol):
    """What :class:`~pipeline.session.session.Session` needs of its input stream."""

    @property
    def stopped(self) -> str | None:
        """Why the stream's audio is dropped until a new ``session.start`` (it was
        reported already), or None."""

    def seconds(self, data: bytes) -> float:
        """The audio a wire frame holds (s), for the client's budget (a frame that is not
        audio counts 0: the budget's minimum applies)."""

    async def feed(self, data: bytes, *, quiet: bool) -> tuple[np.ndarray, str | None]:
        """A wire frame (``quiet``: no speech is in progress or pending, it may wait).
        Returns (the float32 16 kHz samples ready now, shape (n,); an error message for
        the client or None)."""

    async def end(self) -> np.ndarray:
        """``input.end``: everything held, decoded, and the resampler's tail."""


class PcmInput:
    """PCM16 or float32 input (:class:`PcmDecoder`); a format mismatch stops the stream."""

    def __init__(self, fmt: PcmFormat) -> None:
        self.fmt = fmt
        self.bytes_per_s = fmt.frame_bytes * fmt.sample_rate
        self._decoder = PcmDecoder(fmt)
        self._quiet = QuietBatcher(max(1, self.bytes_per_s * QUIET_BATCH_MS // 1000))

    @property
    def stopped(self) -> str | None:
        return None if self._decoder.error is None else str(self._decoder.error)

    def seconds(self, data: bytes) -> float:
        return len(data) / self.bytes_per_s

    async def feed(self, data: bytes, *, quiet: bool) -> tuple[np.ndarray, str | None]:
        data = self._quiet.take(data, quiet=quiet)
        return self._decode(data) if data else (np.zeros(0, np.float32), None)

    def _decode(self, data: bytes) -> tuple[np.ndarray, str | None]:
        try:
            return self._decoder.feed(data), None
        except AudioFormatError as exc:
            return np.zeros(0, np.float32), f"{exc}; audio is ignored until a new session.start"

    async def end(self) -> np.ndarray:
        held = self._quiet.drain()
        samples = self._decode(held)[0] if held and self._decoder.error is None else np.zeros(0, np.float32)
        return np.concatenate([samples, self._decoder.flush()])


class OpusInput:
    """Opus input: one packet per wire frame (:class:`~audio.opus.OpusDecoder` on the codec
    pool). A corrupt packet is dropped and reported — the first, then the 10th, 100th, ...
    (so a flood of them costs the client a few messages, not one each)."""

    def __init__(self, channels: int) -> None:
        self._decoder = OpusDecoder(channels)
        self._held: list[bytes] = []
        self.corrupt = 0  # packets dropped so far

    @property
    def stopped(self) -> str | None:
        return None

    def seconds(self, data: bytes) -> float:
        try:
            return packet_seconds(data)
        except AudioFormatError:
            return 0.0

    async def feed(self, data: bytes, *, quiet: bool) -> tuple[np.ndarray, str | None]:
        self._held.append(bytes(data))
        if quiet and len(self._held) < QUIET_PACKETS:
            return np.zeros(0, np.float32), None
        return await self._decode()

    async def _decode(self) -> tuple[np.ndarray, str | None]:
        packets, self._held = self._held, []
        if not packets:
            return np.zeros(0, np.float32), None
        samples, bad = await run_codec(self._decoder.decode, packets)
        report = None
        for _ in range(bad):
            self.corrupt += 1
            if str(self.corrupt).rstrip("0") == "1":  # 1, 10, 100, ...
                report = (f"a binary frame is not an Opus packet: dropped ({self.corrupt} so far); "
                          "send one Opus packet per frame")
        return samples, report

    async def end(self) -> np.ndarray:
        samples, _ = await self._decode()
        return np.concatenate([samples, self._decoder.flush()])
