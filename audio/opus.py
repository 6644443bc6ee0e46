"""Opus on voxpipe's WebSocket: one Opus packet per binary frame, both ways.

The codec is libopus through PyAV (``av``, already installed with faster-whisper); nothing
here encodes or decodes audio itself. A client that declares ``format: "opus"`` in
``session.start`` sends each Opus packet (RFC 6716; 20 ms is usual, 2.5–120 ms allowed) as
one binary frame; with ``output_format: "opus"`` each reply-audio frame carries one 20 ms
packet after its 4-byte ``response_id`` (docs/PROTOCOL.md). Each reply is an Opus stream of
its own (a client decodes each ``response_id`` with a fresh decoder).

The work runs on :data:`CODEC_POOL`, never on the event loop (:func:`run_codec`): decoding a
20 ms packet and resampling it to 16 kHz, or encoding one, costs tens to hundreds of
microseconds — too much to pay 50 times a second per session on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

import av
import numpy as np
import soxr

from audio.pcm import OPUS_RATES, RATE, AudioFormatError, float_to_pcm16

DECODE_RATE = 48000
"""libopus decodes at this rate here (every packet, whatever rate it was encoded at)."""
FRAME_S = 0.02
"""The reply's packets: 20 ms each (libopus's default frame)."""
OUTPUT_BITRATE = 32000
"""The reply's Opus bit rate (bit/s): speech at 24 kHz (Opus SWB) sounds clean at 24–32 kb/s."""
MAX_PACKET_S = 0.12
"""The longest Opus packet (s): RFC 6716 §3.2.5 caps a packet at 120 ms of audio."""

CODEC_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="voxpipe-codec")
"""Where Opus work runs: off the event loop, and off the default executor (model loaders,
file reads) so that neither waits for the other. PyAV releases the GIL while libopus works."""

T = TypeVar("T")


async def run_codec(fn: Callable[..., T], *args: object) -> T:
    """Run ``fn(*args)`` on :data:`CODEC_POOL` and wait for it."""
    return await asyncio.get_running_loop().run_in_executor(CODEC_POOL, fn, *args)


# Frame sizes (s) of the 32 TOC configurations, RFC 6716 §3.1, Table 2: SILK NB/MB/WB
# (10, 20, 40, 60 ms), Hybrid SWB/FB (10, 20 ms), CELT NB/WB/SWB/FB (2.5, 5, 10, 20 ms).
_CONFIG_S = ((0.01, 0.02, 0.04, 0.06) * 3 + (0.01, 0.02) * 2 + (0.0025, 0.005, 0.01, 0.02) * 4)


def packet_seconds(packet: bytes) -> float:
    """The audio an Opus packet holds (s), read from its TOC byte (RFC 6716 §3.1: the
    configuration gives the frame size, the code the number of frames; code 3 counts them
    in its second byte).

    Raises:
        AudioFormatError: an empty packet, a code-3 packet without its frame count, or one
            over 120 ms (§3.2.5): not Opus.
    """
    if not packet:
        raise AudioFormatError("an empty Opus packet")
    toc = packet[0]
    frame_s = _CONFIG_S[toc >> 3]
    code = toc & 0x3
    if code == 0:
        frames = 1
    elif code in (1, 2):
        frames = 2
    elif len(packet) < 2:
        raise AudioFormatError("an Opus packet of code 3 without its frame count")
    else:
        frames = packet[1] & 0x3F
    seconds = frame_s * frames
    if not 0 < seconds <= MAX_PACKET_S + 1e-9:
        raise AudioFormatError(f"an Opus packet of {seconds * 1000:g} ms (at most 120 ms)")
    return seconds


class OpusDecoder:
    """Opus packets → mono float32 at ``rate`` (libopus via PyAV, then soxr).

    Args:
        channels: 1 or 2 (what the sender encoded; stereo is mixed down).
        rate: the output rate (Hz; default 16 kHz, the pipeline's).

    Not thread-safe: one call at a time (a session awaits each decode before the next).
    """

    def __init__(self, channels: int = 1, rate: int = RATE) -> None:
        self.channels, self.rate = channels, rate
        self._ctx = self._new_context()
        self._resampler = self._new_resampler()

    def _new_resampler(self) -> soxr.ResampleStream:
        return soxr.ResampleStream(DECODE_RATE, self.rate, 1, dtype="float32", quality="HQ")

    def _new_context(self) -> av.AudioCodecContext:
        ctx = av.CodecContext.create("libopus", "r")
        ctx.sample_rate = DECODE_RATE
        ctx.layout = "stereo" if self.channels == 2 else "mono"
        return ctx

    def decode(self, packets: Sequence[bytes]) -> tuple[np.ndarray, int]:
        """Decode ``packets`` in order. Returns (float32 samples at ``rate``, shape (n,); the
        number of packets that were not Opus and were dropped). A corrupt packet loses its
        own audio only: the stream goes on with the next one."""
        parts: list[np.ndarray] = []
        bad = 0
        for packet in packets:
            try:
                packet_seconds(packet)
                frames = self._ctx.decode(av.Packet(packet))
            except (AudioFormatError, av.error.FFmpegError):
                bad += 1
                continue
            for frame in frames:
                x = frame.to_ndarray().astype(np.float32)
                if frame.format.name.startswith("s16"):
                    x /= 32768.0
                # packed stereo comes as one row (L R L R ...), planar as one row per channel
                mono = x.reshape(-1, 2).mean(axis=1) if frame.layout.nb_channels == 2 and x.shape[0] == 1 \
                    else x.mean(axis=0)
                parts.append(self._resampler.resample_chunk(mono.astype(np.float32)))
        out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
        return out.astype(np.float32, copy=False), bad

    def flush(self) -> np.ndarray:
        """End of the stream (``input.end``): the resampler's tail (float32 at ``rate``).
        More packets may follow (the next turn): they start a fresh resampler."""
        tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True).astype(np.float32)
        self._resampler = self._new_resampler()
        return tail


class OpusEncoder:
    """PCM16 mono at ``rate`` → 20 ms Opus packets (libopus via PyAV, ``voip`` mode).

    Args:
        rate: one of :data:`OPUS_RATES` (Hz).
        bitrate: bit/s (default :data:`OUTPUT_BITRATE`).

    Raises:
        ValueError: a rate Opus does not take.

    Samples short of a whole packet wait for the next :meth:`encode`; :meth:`flush` pads
    them with silence. Not thread-safe: one call at a time.
    """

    def __init__(self, rate: int, bitrate: int = OUTPUT_BITRATE) -> None:
        if rate not in OPUS_RATES:
            raise ValueError(f"Opus takes {', '.join(map(str, OPUS_RATES))} Hz, not {rate}")
        self.rate = rate
        self.frame = int(rate * FRAME_S)
        ctx = av.CodecContext.create("libopus", "w")
        ctx.sample_rate, ctx.layout, ctx.format, ctx.bit_rate = rate, "mono", "s16", bitrate
        ctx.options = {"application": "voip", "frame_duration": str(int(FRAME_S * 1000))}
        ctx.open()
        self._ctx = ctx
        self._held = np.zeros(0, np.int16)
        self._odd = b""  # a byte of a sample split between two calls
        self._pts = 0

    def encode(self, pcm16: bytes) -> list[bytes]:
        """Encode little-endian PCM16 mono bytes; returns the packets now complete."""
        data = self._odd + bytes(pcm16)
        even = len(data) - len(data) % 2
        self._odd = data[even:]
        x = np.concatenate([self._held, np.frombuffer(data[:even], dtype="<i2")])
        n = len(x) // self.frame * self.frame
        self._held = x[n:]
        return self._encode(x[:n])

    def flush(self) -> list[bytes]:
        """The held samples padded with silence to a whole packet, and the encoder's
        remaining packets (the end of the stream)."""
        x = self._held
        self._held, self._odd = np.zeros(0, np.int16), b""
        pad = (-len(x)) % self.frame
        packets = self._encode(np.concatenate([x, np.zeros(pad, np.int16)])) if len(x) else []
        return packets + [bytes(p) for p in self._ctx.encode(None)]

    def _encode(self, x: np.ndarray) -> list[bytes]:
        packets: list[bytes] = []
        for i in range(0, len(x), self.frame):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, i:i + self.frame]), format="s16",
                                               layout="mono")
            frame.sample_rate, frame.pts = self.rate, self._pts
            self._pts += self.frame
            packets += [bytes(p) for p in self._ctx.encode(frame)]
        return packets


class ReplyDecoder:
    """A client's side of Opus reply audio: each ``response_id`` is its own Opus stream
    (docs/PROTOCOL.md), decoded with its own :class:`OpusDecoder` to PCM16 at ``rate``.

    Args:
        rate: the session's ``output_sample_rate`` (Hz).
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._streams: dict[int, OpusDecoder] = {}

    def pcm16(self, response_id: int, packet: bytes) -> bytes:
        """One reply-audio packet → little-endian PCM16 mono bytes at ``rate`` (b"" for a
        packet that is not Opus)."""
        decoder = self._streams.get(response_id)
        if decoder is None:
            if len(self._streams) >= 8:  # replies long over: forget the oldest
                del self._streams[next(iter(self._streams))]
            decoder = self._streams[response_id] = OpusDecoder(rate=self.rate)
        y, _ = decoder.decode([packet])
        return float_to_pcm16(y)
