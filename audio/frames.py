"""The binary frame of voxpipe's WebSocket protocol: reply audio, server → client.

A frame is a 4-byte little-endian unsigned ``response_id`` followed by PCM16 mono samples
at the session's output rate (docs/PROTOCOL.md). The server writes it
(:mod:`server.outbox`) and the clients read it (:mod:`clients.turn`, :mod:`clients.mic`):
it sits in the lowest room so that neither depends on the other.
"""

from __future__ import annotations

import struct

AUDIO_HEADER = struct.Struct("<I")
"""The frame's header: the reply's ``response_id`` (uint32, little-endian)."""


def audio_frame(response_id: int, pcm16: bytes) -> bytes:
    """A binary reply-audio frame: ``<I`` response_id + PCM16 mono bytes."""
    return AUDIO_HEADER.pack(response_id) + pcm16


def parse_audio_frame(frame: bytes) -> tuple[int, bytes]:
    """Split a binary reply-audio frame into (response_id, PCM16 bytes).

    Raises:
        ValueError: the frame is shorter than its header.
    """
    if len(frame) < AUDIO_HEADER.size:
        raise ValueError("audio frame shorter than its 4-byte header")
    return AUDIO_HEADER.unpack_from(frame)[0], frame[AUDIO_HEADER.size :]
