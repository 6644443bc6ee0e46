"""A WebRTC client of ``POST /webrtc/offer`` in aiortc (the ``webrtc`` extra), and an RTP path
that loses and reorders packets: what the tests (tests/test_webrtc.py) and
``voxpipe bench voice --transport webrtc`` talk to the server with.

:class:`RtcClient` sends a clip as its microphone track (real time, 20 ms frames, then
silence), posts its offer (non-trickle: aiortc gathers its candidates before it returns the
description), reads the protocol's events on the ``events`` data channel and measures the
reply track frame by frame. :func:`lossy_rtp` makes the client's outgoing RTP lose and
reorder packets, seeded, below SRTP (what a lossy network does to the Opus packets).
"""

from __future__ import annotations

import asyncio
import fractions
import functools
import json
import math
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import is_rtcp
from av import AudioFrame, Packet

from audio.opus import OpusEncoder
from clients.turn import opus_silence
from server.webrtc import jitter

RATE = 48000
FRAME = 960  # 20 ms at 48 kHz
LOUD_RMS = 0.01
"""A received reply frame this loud (RMS, full scale 1) holds speech, not Opus's silence."""
MIC_BITRATE = 64000
"""The microphone's Opus bit rate (bit/s, mono at 48 kHz). 32 kb/s lost the high end of the
words under the 5 % loss test (Whisper heard "America" for "Americans")."""


def encode_clip(pcm: np.ndarray) -> list[bytes]:
    """``pcm`` (int16 mono, 48 kHz) as 20 ms Opus packets (a fresh encoder; ``flush`` pads
    the last packet with silence); none for an empty clip."""
    if not len(pcm):
        return []
    enc = OpusEncoder(RATE, MIC_BITRATE)
    return enc.encode(pcm.astype("<i2").tobytes()) + enc.flush()


@functools.cache
def _silence() -> bytes:
    """One 20 ms Opus packet of silence (made once)."""
    return opus_silence(RATE)


def post(url: str, body: bytes | str, headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """POST ``body`` to ``url`` (blocking; call through ``asyncio.to_thread``): (status,
    headers with lower-case names, text)."""
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read().decode()


class ClipTrack(MediaStreamTrack):
    """A microphone that plays ``pcm`` (int16 mono at 48 kHz) once in real time, 20 ms a
    packet, then silence; ``t0`` is the wall time (monotonic s) its first packet went out,
    ``done_at`` the wall time its clip's last packet did, ``sent_at`` each packet's (a busy
    client's packets go out late: :meth:`spoken_at` counts that in).

    It sends nothing until :meth:`start` (:meth:`RtcClient.connect` calls it once the
    ``events`` channel is open, so the server's DTLS is up and takes every packet): packets
    sent before that can be lost while the server finishes its handshake, and the session's
    audio clock, which starts at the first packet it decodes, would then run behind ``t0``
    by what was lost (up to a second was seen), putting a turn's end of speech, ``t0`` plus
    ``speech.stopped``'s ``audio_ms``, that much too early.

    The clip is encoded before it plays (Opus, mono, :data:`MIC_BITRATE`) and the silence
    after it is one made-once packet: a browser encodes on its own machine, but this client
    shares the server's, and aiortc encoding each frame in its executor (with its level
    measured in Python) took CPU the server's models waited for (docs/BENCHMARKS.md, issue 34).
    """

    kind = "audio"

    def __init__(self, pcm: np.ndarray) -> None:
        super().__init__()
        self._packets = encode_clip(pcm)
        self._k = 0  # the next packet of the clip
        self.t0: float | None = None
        self.done_at: float | None = None
        self.n = 0
        self.sent_at: list[float] = []
        self._started = asyncio.Event()

    def start(self) -> None:
        """Let the track send (its clock, ``t0``, starts with its first packet)."""
        self._started.set()

    def play(self, pcm: np.ndarray) -> None:
        """Play ``pcm`` next (after what is left of the current clip)."""
        self._packets = self._packets[self._k:] + encode_clip(pcm)
        self._k, self.done_at = 0, None

    async def recv(self) -> Packet:  # aiortc sends a Packet as it is (no encoder of its own)
        if self.readyState != "live":
            raise MediaStreamError
        if self.t0 is None:
            await self._started.wait()
            if self.readyState != "live":
                raise MediaStreamError
            self.t0 = time.monotonic()
        else:
            self.n += 1
            await asyncio.sleep(max(0.0, self.t0 + self.n * FRAME / RATE - time.monotonic()))
        if self._k < len(self._packets):
            payload = self._packets[self._k]
            self._k += 1
            if self._k == len(self._packets):
                self.done_at = time.monotonic()
        else:
            payload = _silence()
        packet = Packet(payload)
        packet.pts, packet.time_base = self.n * FRAME, fractions.Fraction(1, RATE)
        self.sent_at.append(time.monotonic())
        return packet

    def spoken_at(self, audio_ms: float) -> float | None:
        """When the sample ``audio_ms`` into the track went out (monotonic s): its place
        on the track's clock, plus how late its frame was handed to aiortc (as
        :meth:`clients.turn.Turn.finish` counts a WebSocket client's lag); None before the
        first frame."""
        if self.t0 is None or not self.sent_at:
            return None
        k = min(len(self.sent_at) - 1, max(0, math.ceil(audio_ms * RATE / 1000 / FRAME) - 1))
        return self.t0 + audio_ms / 1000 + max(0.0, self.sent_at[k] - (self.t0 + k * FRAME / RATE))


@dataclass
class Heard:
    """The reply track as received: per frame its arrival (monotonic s) and RMS."""

    times: list[float] = field(default_factory=list)
    rms: list[float] = field(default_factory=list)
    rate: int = RATE
    samples: int = 0

    def loud_s(self, after: float = 0.0) -> float:
        """Seconds of loud (speech) frames that arrived after ``after``."""
        return sum(0.02 for t, r in zip(self.times, self.rms) if t >= after and r >= LOUD_RMS)

    def first_loud(self, after: float = 0.0) -> float | None:
        """When the first loud frame after ``after`` arrived (None: none yet)."""
        return next((t for t, r in zip(self.times, self.rms) if t >= after and r >= LOUD_RMS), None)


@dataclass
class LossStats:
    """What :func:`lossy_rtp` did: RTP packets seen, dropped, held back one packet."""

    packets: int = 0
    dropped: int = 0
    reordered: int = 0


def lossy_rtp(pc: RTCPeerConnection, drop: float, reorder: float, seed: int) -> LossStats:
    """Make ``pc``'s outgoing RTP (not RTCP, not the data channel) lose a ``drop`` share of
    its packets and swap a ``reorder`` share with the packet after them, from ``seed``.
    Wraps the DTLS transport's ``_send_rtp`` (aiortc 1.x), below the encoder and above
    SRTP: the server sees exactly what a lossy network delivers."""
    rng = random.Random(seed)
    stats = LossStats()
    transports = {t.sender.transport for t in pc.getTransceivers()}
    for transport in transports:
        send = transport._send_rtp
        held: list[bytes] = []

        async def lossy(data: bytes, send=send, held=held) -> None:
            if is_rtcp(data):
                await send(data)
                return
            stats.packets += 1
            r = rng.random()
            if r < drop:
                stats.dropped += 1
                return
            if r < drop + reorder and not held:
                stats.reordered += 1
                held.append(data)
                return
            await send(data)
            while held:
                await send(held.pop())

        transport._send_rtp = lossy  # type: ignore[method-assign]
    return stats


class RtcClient:
    """A WebRTC session with a voxpipe server.

    Args:
        http: the server's base URL (``http://127.0.0.1:PORT``).
        pcm: the microphone's clip (int16 mono, 48 kHz; empty: silence).
        session: ``session.start`` fields for the offer.
        headers: extra request headers (a token, an Origin).
        loss: (drop share, reorder share, seed) for the outgoing RTP (:func:`lossy_rtp`;
            ``lost`` then has its counts).
    """

    def __init__(self, http: str, pcm: np.ndarray | None = None, *, session: dict | None = None,
                 headers: dict[str, str] | None = None, loss: tuple[float, float, int] | None = None) -> None:
        self.http, self.session, self.headers, self.loss = http, session or {}, headers or {}, loss
        self.lost: LossStats | None = None
        self.pc = RTCPeerConnection()
        self.mic = ClipTrack(pcm if pcm is not None else np.zeros(0, np.int16))
        self.pc.addTrack(self.mic)
        # the reply in order as it comes, not after aiortc's 4-packet (80 ms) prefetch: the reply's
        # first audio is timed when it arrives, as on /ws (and a browser's buffer holds less)
        self.jitter = jitter.install(self.pc.getTransceivers()[0].receiver)
        self.channel = self.pc.createDataChannel("events")
        self.events: list[dict] = []
        self.times: list[float] = []  # each event's arrival (monotonic s)
        self.heard = Heard()
        self._new = asyncio.Event()
        self._open = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self.channel.on("message", self._on_message)
        self.channel.on("open", self._open.set)
        self.pc.on("track", self._on_track)

    def _on_message(self, message: str | bytes) -> None:
        self.events.append(json.loads(message))
        self.times.append(time.monotonic())
        self._new.set()

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._tasks.append(asyncio.ensure_future(self._listen(track)))

    async def _listen(self, track: MediaStreamTrack) -> None:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            assert isinstance(frame, AudioFrame)  # an audio track's frames
            x = frame.to_ndarray().astype(np.float32).reshape(-1, len(frame.layout.channels)).mean(axis=1) / 32768
            self.heard.times.append(time.monotonic())
            self.heard.rms.append(float(np.sqrt(np.mean(x * x))) if len(x) else 0.0)
            self.heard.rate, self.heard.samples = frame.sample_rate, self.heard.samples + frame.samples
            self._new.set()

    async def offer(self) -> tuple[int, dict, str]:
        """Post the offer; (status, headers, body) of the answer or refusal."""
        await self.pc.setLocalDescription(await self.pc.createOffer())
        if self.loss is not None and self.lost is None:
            self.lost = lossy_rtp(self.pc, *self.loss)
        body = json.dumps({"type": "offer", "sdp": self.pc.localDescription.sdp, "session": self.session})
        return await asyncio.to_thread(post, self.http + "/webrtc/offer", body, self.headers)

    async def connect(self, deadline_s: float = 60) -> None:
        """Offer, take the answer, and wait for the ``events`` channel to open.

        Raises:
            ConnectionError: the server refused the offer (its status and answer).
            TimeoutError: the channel did not open within ``deadline_s``.
        """
        status, _, body = await self.offer()
        if status != 200:
            raise ConnectionError(f"the offer was refused: HTTP {status}: {body.strip()[:300]}")
        answer = json.loads(body)
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        await asyncio.wait_for(self._open.wait(), deadline_s)
        self.mic.start()

    def send(self, event: dict) -> None:
        self.channel.send(json.dumps(event))

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]

    def at(self, event: dict) -> float:
        """When ``event`` arrived (monotonic s)."""
        return self.times[next(i for i, e in enumerate(self.events) if e is event)]

    async def wait_until(self, cond, deadline_s: float, what: str):
        """Wait until ``cond()`` is truthy (re-checked on every event and reply frame);
        returns its value. ``deadline_s`` only bounds a hang."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        while not (value := cond()):
            self._new.clear()
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError(f"{what}: not within {deadline_s} s; events {[e['type'] for e in self.events]}")
            try:
                await asyncio.wait_for(self._new.wait(), min(left, 1.0))
            except TimeoutError:
                pass
        return value

    async def bytes_moved(self) -> tuple[int, int]:
        """(bytes sent, bytes received) on the client's transport so far (ICE level)."""
        sent = received = 0
        for stat in (await self.pc.getStats()).values():
            if stat.type == "transport":
                sent += stat.bytesSent
                received += stat.bytesReceived
        return sent, received

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.pc.close()
