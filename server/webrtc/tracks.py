"""Audio between aiortc and the session: the reply track the peer connection sends, and the
received frames as the PCM16 the session is fed.

:class:`ReplyTrack` is the outgoing ``MediaStreamTrack``: every 20 ms, paced on the wall clock
like aiortc's own ``AudioStreamTrack``, it hands the sender one Opus packet of the next 20 ms
of reply audio. It encodes the packets itself (mono, :data:`REPLY_BITRATE`, on the codec pool:
:func:`audio.opus.run_codec`): given frames, aiortc encodes each at 96 kb/s stereo in its
executor and measures its level in Python on the event loop.

Between replies it sends nothing (discontinuous transmission, as Opus DTX, RFC 7587 §3.1.3):
after a reply's last audio :data:`SETTLE_FRAMES` frames of silence go out, then the track waits
until reply audio is queued, and its next packet carries the wall clock's timestamp, so the
receiver's jitter buffer (a browser's NetEq, aiortc's) sees a gap in time, not a burst. A
stream of silence packets 50 times a second for the session's whole life cost both peers
CPU — a sender wake-up, RTP, SRTP and a send here, a receive, decode and playout there — that
the models on a small machine wait for (docs/BENCHMARKS.md, issue 34), and a reply's first
audio no longer waits for the next 20 ms tick of a running stream.

The session's Responder already paces reply audio at most ``playback_lead_s`` (1 s) ahead
of real time, so the queue stays short; a cancelled reply's
queued audio is dropped at once and a paused one's held back until it resumes, as the web
demo does with its player (docs/PROTOCOL.md, "Talking over a reply").

:func:`frame_pcm16` turns a decoded ``av.AudioFrame`` (aiortc's Opus decoder gives s16
interleaved stereo at 48 kHz) into the bytes the session was declared to take, with silence
where packets were lost.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque

import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, AudioResampler, Packet

from audio.opus import OpusEncoder, run_codec

from .types import FRAME_S, INPUT_CHANNELS, TRACK_RATE

FRAME_SAMPLES = round(TRACK_RATE * FRAME_S)
"""Samples in one reply frame (960)."""
FRAME_BYTES = 2 * FRAME_SAMPLES
"""Bytes of one mono PCM16 reply frame."""
MAX_QUEUED_S = 30.0
"""Reply audio queued at most (s); past it the oldest is dropped (never reached while the
Responder paces: it sends at most ~1 s ahead)."""
MAX_GAP_S = 0.5
"""A gap in the received audio's timestamps up to this long is filled with silence (s)."""
REPLY_BITRATE = 32000
"""The reply's Opus bit rate (bit/s, mono at 48 kHz): as ``/ws``'s Opus replies."""
SETTLE_FRAMES = 5
"""After a reply's last audio, this many frames of silence still go through the encoder (its
lookahead's tail, and its state settling to silence as the receiver's decoder does) before
the track goes quiet."""
MAX_LATE_S = 1.0
"""A frame due this long ago or more (the loop stalled) is not caught up on: the track's clock
moves on to now, its timestamps still rising."""
_TIME_BASE = fractions.Fraction(1, TRACK_RATE)
_SILENCE = bytes(FRAME_BYTES)
_silence_packet: bytes | None = None


def silence_packet() -> bytes:
    """One 20 ms Opus packet of silence at 48 kHz (made once): sent when the encoder has
    no packet yet (its first frames)."""
    global _silence_packet
    if _silence_packet is None:
        _silence_packet = OpusEncoder(TRACK_RATE, REPLY_BITRATE).encode(_SILENCE)[0]
    return _silence_packet


class ReplyTrack(MediaStreamTrack):
    """The reply audio as an aiortc audio track: PCM16 mono at :data:`~.types.TRACK_RATE` in,
    one 20 ms Opus packet per :meth:`recv` out; between replies :meth:`recv` waits (module
    docstring).

    Attributes:
        frames, audio_frames: frames handed out, and those that held reply audio.
    """

    kind = "audio"

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[int, bytes]] = deque()  # (response_id, PCM16 bytes), in order
        self._queued = 0  # bytes in _queue
        self._held: set[int] = set()  # paused replies: their audio waits
        self._start: float | None = None
        self._pts = 0
        self._encoder = OpusEncoder(TRACK_RATE, REPLY_BITRATE)
        self._quiet = SETTLE_FRAMES  # frames of silence since the last audio
        self._audio = asyncio.Event()  # set when audio that may play is queued (or the track stops)
        self.frames = self.audio_frames = 0

    @property
    def queued_s(self) -> float:
        """Reply audio queued (s), held replies' included."""
        return self._queued / 2 / TRACK_RATE

    def push(self, response_id: int, pcm16: bytes) -> None:
        """Queue reply audio: PCM16 mono bytes at :data:`~.types.TRACK_RATE` (an odd byte
        count loses its last byte)."""
        pcm16 = pcm16[: len(pcm16) & ~1]
        if not pcm16:
            return
        self._queue.append((response_id, pcm16))
        self._queued += len(pcm16)
        if response_id not in self._held:
            self._audio.set()
        while self._queued > MAX_QUEUED_S * TRACK_RATE * 2 and len(self._queue) > 1:
            self._queued -= len(self._queue.popleft()[1])

    def drop(self, response_id: int) -> None:
        """Drop reply ``response_id``'s queued audio (cancelled: silent from the next frame)."""
        self._held.discard(response_id)
        kept = deque(c for c in self._queue if c[0] != response_id)
        self._queued = sum(len(c[1]) for c in kept)
        self._queue = kept

    def hold(self, response_id: int, held: bool) -> None:
        """Hold back reply ``response_id``'s audio (paused), or let it play on (resumed)."""
        (self._held.add if held else self._held.discard)(response_id)
        if not held and any(rid == response_id for rid, _ in self._queue):
            self._audio.set()

    def clear(self) -> None:
        """Drop everything queued (a new ``session.start``: the old replies are gone)."""
        self._queue.clear()
        self._held.clear()
        self._queued = 0

    def _next_pcm(self) -> bytes:
        """The next frame's bytes: queued audio of replies not held, in order, padded with
        silence."""
        out = bytearray()
        i = 0
        while len(out) < FRAME_BYTES and i < len(self._queue):
            rid, pcm = self._queue[i]
            if rid in self._held:
                i += 1
                continue
            take = FRAME_BYTES - len(out)
            out += pcm[:take]
            self._queued -= min(take, len(pcm))
            if len(pcm) > take:
                self._queue[i] = (rid, pcm[take:])
            else:
                del self._queue[i]
        if not out:
            return _SILENCE
        self.audio_frames += 1
        return bytes(out) + _SILENCE[len(out):]

    def stop(self) -> None:
        super().stop()
        self._audio.set()  # a recv waiting for audio ends

    def _playable(self) -> bool:
        """Audio of a reply not held is queued."""
        return any(rid not in self._held for rid, _ in self._queue)

    async def _until_audio(self) -> None:
        """Wait until audio that may play is queued (or the track stops)."""
        while not self._playable() and self.readyState == "live":
            self._audio.clear()
            await self._audio.wait()

    def _tick(self, now: float) -> int:
        """The track's timestamp (samples) of the 20 ms tick ``now`` falls in."""
        assert self._start is not None
        return int((now - self._start) * TRACK_RATE) // FRAME_SAMPLES * FRAME_SAMPLES

    async def recv(self) -> Packet:  # aiortc sends a Packet as it is (no encoder of its own)
        """The next 20 ms Opus packet, due :data:`~.types.FRAME_S` after the previous one on
        the wall clock (late ones come at once: the sender catches up, up to
        :data:`MAX_LATE_S`); while quiet, the first packet of the next reply audio, as soon
        as it is queued, at the wall clock's timestamp.

        Raises:
            MediaStreamError: the track was stopped.
        """
        if self.readyState != "live":
            raise MediaStreamError
        now = time.monotonic()
        if self._start is None:
            self._start = now
        else:
            self._pts += FRAME_SAMPLES
            if self._quiet >= SETTLE_FRAMES and not self._playable():  # quiet: nothing goes out
                await self._until_audio()
                if self.readyState != "live":
                    raise MediaStreamError
                now = time.monotonic()
                self._pts = max(self._pts, self._tick(now))
            wait = self._start + self._pts / TRACK_RATE - now
            if wait > 0:
                await asyncio.sleep(wait)
            elif wait < -MAX_LATE_S:  # the loop stalled: on from now, no burst, timestamps still rising
                self._pts = self._tick(now)
        pcm = self._next_pcm()
        self._quiet = self._quiet + 1 if pcm is _SILENCE else 0
        payload = next(iter(await run_codec(self._encoder.encode, pcm)), None)
        packet = Packet(payload or silence_packet())
        packet.pts = self._pts
        packet.time_base = _TIME_BASE
        self.frames += 1
        return packet


class FrameConverter:
    """Decoded frames → interleaved PCM16 at :data:`~.types.TRACK_RATE` with
    :data:`~.types.INPUT_CHANNELS` channels, the format the session is declared with. Opus
    frames from aiortc already are (a copy of their samples); anything else goes through
    libswresample (``av.AudioResampler``, made on first need).

    A frame whose ``pts`` comes after a gap (packets the jitter buffer gave up on: lost, or
    too late) is preceded by silence as long as the gap, up to :data:`MAX_GAP_S`, so the
    session's audio clock (``audio_ms``, turn lengths, the silence that ends a turn) keeps
    time with the client's. A longer jump (the sender paused its track, or restarted) is
    not filled.

    Attributes:
        frames: frames converted. concealed_s: silence put in for gaps (s).
    """

    def __init__(self) -> None:
        self._resampler: AudioResampler | None = None
        self._next_pts: int | None = None
        self.frames = 0
        self.concealed_s = 0.0

    def __call__(self, frame: AudioFrame) -> bytes:
        """The frame's samples as bytes, after the silence for a gap before it (empty while
        a resampler fills its first frame)."""
        self.frames += 1
        gap = b""
        if frame.pts is not None and frame.time_base is not None:
            pts = int(frame.pts * frame.time_base * TRACK_RATE)
            if self._next_pts is not None and 0 < pts - self._next_pts <= MAX_GAP_S * TRACK_RATE:
                gap = bytes(2 * INPUT_CHANNELS * (pts - self._next_pts))
                self.concealed_s += (pts - self._next_pts) / TRACK_RATE
            self._next_pts = pts + round(frame.samples * TRACK_RATE / frame.sample_rate)
        if frame.format.name == "s16" and frame.sample_rate == TRACK_RATE and len(frame.layout.channels) == \
                INPUT_CHANNELS:
            return gap + np.ascontiguousarray(frame.to_ndarray()).tobytes()
        if self._resampler is None:
            self._resampler = AudioResampler(format="s16", layout="stereo", rate=TRACK_RATE)
        return gap + b"".join(np.ascontiguousarray(f.to_ndarray()).tobytes()
                              for f in self._resampler.resample(frame))
