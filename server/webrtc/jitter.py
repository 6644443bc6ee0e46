"""A jitter buffer for the incoming Opus packets that loses what the network lost and no more.

aiortc 1.16 puts audio through its video-minded ``JitterBuffer(capacity=16, prefetch=4)``: at a
missing packet it stalls until 16 newer ones are held, then its overflow rule throws away
*received* packets too, and a packet that comes one place late while it is full costs another;
under a few percent of loss whole stretches of words went missing and Whisper misheard them
(docs/BENCHMARKS.md, "Design measurements"). :class:`AudioJitterBuffer` (one Opus packet = one
frame) hands packets on in order as soon as they are next, waits for a missing one only until
:data:`WAIT_PACKETS` newer ones are held (a packet one or two places late is put back in its
place), then skips it: only the packets the network lost are missing, for 40 ms of delay. The
gaps it leaves are filled with silence by :class:`~server.webrtc.tracks.FrameConverter`, so the
session's clock keeps time.

It replaces the receiver's private buffer (:func:`install`), and :class:`InlineDecoding` its
decoder thread's queue; an aiortc without those attributes keeps its own, with a warning for
the buffer.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import av
from aiortc.codecs import get_decoder
from aiortc.jitterbuffer import JitterFrame
from aiortc.rtp import RtpPacket

logger = logging.getLogger(__name__)

WAIT_PACKETS = 3
"""A missing packet is waited for until this many newer ones are held (40 ms at 20 ms per
packet): reordering up to two places is undone, a loss costs that much delay, once."""
MAX_HELD = 16
"""Packets held at most; past it the oldest go (a burst after a stall: stay near real time)."""
RESTART_GAP = 3000
"""A sequence number this far from the expected one (60 s of 20 ms packets) starts afresh (a
new stream, not loss)."""
_PRIVATE = "_RTCRtpReceiver__jitter_buffer"
_DECODER_QUEUE = "_RTCRtpReceiver__decoder_queue"


class AudioJitterBuffer:
    """Drop-in for aiortc's ``JitterBuffer`` on an audio receiver: :meth:`add` takes each
    received packet (depayloaded: its ``_data`` set) and returns at most one frame, the next
    in sequence.

    Attributes:
        skipped: packets given up on (lost, or too late); late: packets that came after
            their turn (dropped); duplicates: packets received twice.
    """

    def __init__(self, wait_packets: int = WAIT_PACKETS, max_held: int = MAX_HELD) -> None:
        self.wait_packets, self.max_held = wait_packets, max_held
        self._next: int | None = None  # the next sequence number to hand on, unwrapped
        self._held: dict[int, RtpPacket] = {}
        self.skipped = self.late = self.duplicates = 0

    def add(self, packet: RtpPacket) -> tuple[bool, JitterFrame | None]:
        """Hold ``packet``; return (False: no picture loss to report, the next frame in
        order or None)."""
        seq = packet.sequence_number
        if self._next is None:
            self._next = seq
        ext = self._next + ((seq - self._next + 0x8000) & 0xFFFF) - 0x8000  # nearest unwrapped number
        if abs(ext - self._next) > RESTART_GAP:
            self._held.clear()
            self._next = ext
        if ext < self._next:
            self.late += 1
            return False, None
        if ext in self._held:
            self.duplicates += 1
            return False, None
        self._held[ext] = packet
        while len(self._held) > self.max_held:  # the oldest goes too
            self._skip_to(min(self._held))
            self._held.pop(self._next)
            self._next += 1
            self.skipped += 1
        if self._next not in self._held:
            if len(self._held) < self.wait_packets:
                return False, None
            self._skip_to(min(self._held))
        out = self._held.pop(self._next)
        self._next += 1
        return False, JitterFrame(data=out._data, timestamp=out.timestamp)  # type: ignore[attr-defined]

    def _skip_to(self, ext: int) -> None:
        assert self._next is not None
        self.skipped += ext - self._next
        self._next = ext


class InlineDecoding:
    """Stands in for an aiortc receiver's decoder queue (:func:`install`): each frame put is
    decoded at once, on the event loop, and its samples go to the receiver's track. A 20 ms
    Opus packet decodes in a fraction of a millisecond; handing it to aiortc's decoder thread
    and the frame back woke two threads per packet, 50 times a second, for CPU that the
    models on a small machine waited for (docs/BENCHMARKS.md, issue 34). The decoder thread
    aiortc still starts waits in :meth:`get` until the receiver stops."""

    def __init__(self, receiver: Any) -> None:
        self._receiver = receiver
        self._decoder: Any = None
        self._codec: str | None = None
        self._stopped = threading.Event()
        self.frames = self.errors = 0

    def put(self, task: tuple[Any, Any] | None) -> None:
        """Decode ``(codec, encoded frame)`` onto the track's queue; None: the end."""
        queue = self._receiver._track._queue
        if task is None:
            queue.put_nowait(None)
            self._stopped.set()
            return
        codec, encoded = task
        if codec.name != self._codec:
            self._decoder, self._codec = get_decoder(codec), codec.name
        try:
            frames = self._decoder.decode(encoded)
        except av.FFmpegError as exc:  # its state kept, as aiortc's thread does
            self.errors += 1
            logger.warning("WebRTC: could not decode a %s frame: %s", codec.name, exc)
            return
        for frame in frames:
            self.frames += 1
            queue.put_nowait(frame)

    def get(self) -> None:
        """aiortc's decoder thread: nothing to do until the receiver stops."""
        self._stopped.wait()


def install(receiver: Any) -> AudioJitterBuffer | None:
    """Give aiortc audio ``receiver`` an :class:`AudioJitterBuffer` (before its first packet);
    None (and a warning) where this aiortc keeps its buffer elsewhere."""
    if not hasattr(receiver, _PRIVATE):
        logger.warning("WebRTC: this aiortc has no %s: its own jitter buffer stays (bursts of lost audio "
                       "under packet loss)", _PRIVATE)
        return None
    buffer = AudioJitterBuffer()
    setattr(receiver, _PRIVATE, buffer)
    if hasattr(receiver, _DECODER_QUEUE) and hasattr(receiver, "_track"):
        setattr(receiver, _DECODER_QUEUE, InlineDecoding(receiver))
    return buffer
