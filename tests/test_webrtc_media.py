"""The WebRTC media pieces alone, without a peer connection (server/webrtc/, clients/rtc.py):
the microphone track's clock, the reply track's discontinuous transmission, the received
packets decoded on the loop, the jitter buffer and the frame converter's gaps."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from clients.rtc import RATE
from tests.test_webrtc import DEADLINE_S, tone_clip


async def test_the_microphone_sends_nothing_before_it_is_started_and_times_its_speech_from_its_first_packet():
    """A packet sent before the server's DTLS is up can be lost, and the session's audio
    clock starts at the first packet it decodes: the clip waits for :meth:`ClipTrack.start`,
    and ``spoken_at`` puts a sample at ``t0`` plus its place, plus how late its packet went."""
    from clients.rtc import ClipTrack

    mic = ClipTrack(tone_clip(speech_s=0.2, lead_s=0.0, tail_s=0.0))
    first = asyncio.ensure_future(mic.recv())
    await asyncio.sleep(0.05)
    assert not first.done() and mic.t0 is None and mic.spoken_at(0.0) is None
    mic.start()
    await first
    assert mic.t0 is not None and len(mic.sent_at) == 1
    for _ in range(3):
        await mic.recv()
    assert mic.sent_at[3] >= mic.t0 + 0.06  # real time: 20 ms a packet
    mic.sent_at[2] = mic.t0 + 0.04 + 0.5  # the third packet (40-60 ms) went out 0.5 s late
    assert mic.spoken_at(30.0) == pytest.approx(mic.t0 + 0.03 + max(0.0, mic.sent_at[1] - mic.t0 - 0.02))
    assert mic.spoken_at(50.0) == pytest.approx(mic.t0 + 0.05 + 0.5)
    mic.stop()


async def test_the_reply_track_sends_nothing_between_replies_and_resumes_on_the_wall_clock():
    """Discontinuous transmission: after a reply's last audio the track sends its settling
    frames, then nothing until audio that may play is queued (a held reply's does not wake
    it); the next packet comes at once, stamped with the wall clock's 20 ms tick, so the
    timestamps jump over the quiet, and a stopped track ends a waiting ``recv``."""
    from aiortc.mediastreams import MediaStreamError

    from server.webrtc.tracks import FRAME_SAMPLES, SETTLE_FRAMES, ReplyTrack
    from server.webrtc.types import TRACK_RATE

    track = ReplyTrack()
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(FRAME_SAMPLES * 3) / TRACK_RATE) * 32767).astype("<i2")
    first = await track.recv()  # the stream's first packet: silence, then quiet
    assert first.pts == 0
    waiting = asyncio.ensure_future(track.recv())
    await asyncio.sleep(0.3)
    assert not waiting.done(), "a packet went out with nothing to play"
    track.push(7, tone.tobytes())
    track.hold(7, True)
    track.push(8, b"")  # nothing: no wake-up either
    await asyncio.sleep(0.1)
    assert not waiting.done(), "a held reply's audio went out"
    t = time.monotonic()
    track.hold(7, False)
    packet = await asyncio.wait_for(waiting, DEADLINE_S)
    assert packet.pts >= int(0.38 * TRACK_RATE) and packet.pts % FRAME_SAMPLES == 0, packet.pts
    assert packet.pts <= int((t - track._start + 0.02) * TRACK_RATE) + FRAME_SAMPLES  # the tick it resumed in
    pts = [packet.pts] + [(await track.recv()).pts for _ in range(2 + SETTLE_FRAMES)]
    assert pts == [pts[0] + k * FRAME_SAMPLES for k in range(len(pts))]  # then 20 ms apart, in real time
    assert track.audio_frames == 3
    waiting = asyncio.ensure_future(track.recv())  # settled: quiet again
    await asyncio.sleep(0.1)
    assert not waiting.done()
    track.stop()
    with pytest.raises(MediaStreamError):
        await asyncio.wait_for(waiting, DEADLINE_S)


async def test_received_packets_are_decoded_on_the_loop_and_a_corrupt_one_is_skipped():
    """:class:`~server.webrtc.jitter.InlineDecoding` in place of aiortc's decoder queue: each
    Opus frame becomes a 48 kHz frame on the track's queue as it is put; a corrupt packet is
    counted and skipped (the next decodes); the end reaches the track and frees the thread
    aiortc started."""
    import threading
    from types import SimpleNamespace

    from aiortc import RTCRtpCodecParameters
    from aiortc.jitterbuffer import JitterFrame

    from audio.opus import OpusEncoder
    from server.webrtc.jitter import InlineDecoding

    receiver = SimpleNamespace(_track=SimpleNamespace(_queue=asyncio.Queue()))
    inline = InlineDecoding(receiver)
    thread = threading.Thread(target=inline.get)
    thread.start()
    opus = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
    packets = OpusEncoder(RATE, 32000).encode(tone_clip(0.1, 0.0, 0.0).tobytes())
    inline.put((opus, JitterFrame(data=packets[0], timestamp=0)))
    inline.put((opus, JitterFrame(data=b"\xff" * 3, timestamp=960)))  # not Opus
    inline.put((opus, JitterFrame(data=packets[1], timestamp=1920)))
    queue = receiver._track._queue
    frames = [queue.get_nowait() for _ in range(queue.qsize())]
    assert [f.sample_rate for f in frames] == [48000, 48000] and inline.errors == 1
    inline.put(None)
    assert queue.get_nowait() is None
    thread.join(DEADLINE_S)
    assert not thread.is_alive()


def test_the_jitter_buffer_reorders_skips_only_what_was_lost_and_the_gaps_become_silence():
    import fractions
    import random

    from aiortc.rtp import RtpPacket
    from av import AudioFrame

    from server.webrtc.jitter import AudioJitterBuffer
    from server.webrtc.tracks import FrameConverter

    def packet(n: int) -> RtpPacket:
        p = RtpPacket(sequence_number=n % 65536, timestamp=(n * 960) % (1 << 32))
        p._data = n.to_bytes(4, "big")  # type: ignore[attr-defined]  # what aiortc's depayloader sets
        return p

    rng, jb = random.Random(3), AudioJitterBuffer()
    sent, lost, out, held = 0, set(), [], None
    for n in range(65000, 65000 + 5000):  # through the 16-bit wrap
        r = rng.random()
        sent += 1
        if r < 0.05:
            lost.add(n)
            continue
        if r < 0.07 and held is None:  # this one comes after the next
            held = n
            continue
        for m in [n] + ([held] if held is not None else []):
            frame = jb.add(packet(m))[1]
            if frame is not None:
                out.append(int.from_bytes(frame.data, "big"))
            if held == m:
                held = None
        if n % 97 == 0:
            assert jb.add(packet(n))[1] is None  # a duplicate goes
    assert out == sorted(out) and len(set(out)) == len(out)  # in order, once each
    assert set(range(out[0], out[-1] + 1)) - set(out) == {n for n in lost if out[0] < n < out[-1]}  # only the lost
    assert jb.skipped == len(lost) - sum(1 for n in lost if n > out[-1]) and jb.late == 0 and jb.duplicates > 40

    convert = FrameConverter()  # pts 0, 960, (gap of 2 frames), 3840: 40 ms of silence before the last
    pcm = []
    for pts in (0, 960, 3840):
        f = AudioFrame(format="s16", layout="stereo", samples=960)
        f.planes[0].update(np.full(1920, 1000, "<i2").tobytes())
        f.pts, f.sample_rate, f.time_base = pts, 48000, fractions.Fraction(1, 48000)
        pcm.append(np.frombuffer(convert(f), "<i2"))
    assert [len(x) for x in pcm] == [1920, 1920, 1920 + 2 * 1920] and not pcm[2][:3840].any() and pcm[2][3840:].all()
    assert convert.concealed_s == pytest.approx(0.04)
