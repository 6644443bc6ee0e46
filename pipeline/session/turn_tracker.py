"""The turn tracker: a session's input audio → VAD → :class:`Endpointer` → turn events.

A pure synchronous class (no I/O, no asyncio). It owns the session's one audio buffer:
the recent input (16 kHz mono float32, after the session's ``PcmDecoder``), indexed by
sample position in the session's stream, so the session can hand a turn's pre-roll to the
ASR when speech starts.

Feeding is split in two steps so that the session may run the VAD (the only costly part)
off the event loop for large frames: :meth:`TurnTracker.append` (buffer the samples),
:meth:`TurnTracker.detect` (run the VAD on them: thread-safe with respect to nothing
else, touches only the VAD stream), :meth:`TurnTracker.endpoint` (probabilities → events).
:meth:`TurnTracker.feed` does all three inline.
"""

from __future__ import annotations

import numpy as np

from audio.pcm import RATE
from pipeline.config import TurnConfig
from pipeline.session.end_of_turn import EOT_PRE_MS, EOT_WINDOW_S, EndOfTurnPolicy
from pipeline.session.endpointing import Endpointer
from pipeline.session.types import SpeechEnd, TurnEvent
from pipeline.stages import VadStream

PREROLL = RATE
"""Audio always kept before the newest sample (samples: 1 s)."""

INLINE_VAD_SAMPLES = 4096
"""Frames up to this many samples (256 ms, 8 VAD windows) run the VAD inline on the event
loop; longer ones go to a thread. A Silero v6 window costs about as much as an
``asyncio.to_thread`` hop on an idle loop, and the hop costs far more under load
(docs/BENCHMARKS.md): a typical 20–100 ms client frame is 0–3 windows, cheaper inline than
the hop, and a short block of the loop."""
VAD_PIECE_SAMPLES = 16 * 512
"""Large frames run through the VAD in pieces of this many samples (16 windows), so that a
thread holding the shared model's lock never makes an inline caller wait long."""


class TurnTracker:
    """Track turns in one session's input stream.

    Args:
        cfg: endpointing settings (``pad_ms`` is the audio kept before speech start).
        vad: this session's VAD stream (``audio.vad.VadStream``, or
            :class:`~pipeline.session.endpointing.AllSpeech` when VAD is off).

        policy: the semantic end of turn (None: turns end on silence alone).

    Audio from ``pad_ms`` before speech that has not been confirmed yet stays available
    to :meth:`audio` (as does the last second) until the next :meth:`append`, so the
    session can take a new turn's pre-roll after the :class:`SpeechStart` that confirmed it.
    With a ``policy``, the speech in progress stays too (its last :data:`EOT_WINDOW_S`,
    from :data:`EOT_PRE_MS` before it): the end-of-turn model's input (:meth:`eot_audio`).
    """

    def __init__(self, cfg: TurnConfig, vad: VadStream, policy: EndOfTurnPolicy | None = None) -> None:
        self.vad = vad
        self.endpointer = Endpointer(cfg, policy)
        self.pad = int(cfg.pad_ms * RATE / 1000)
        self._eot_pre = int(EOT_PRE_MS * RATE / 1000) if policy is not None else None
        self._chunks: list[np.ndarray] = []
        self._buf_start = 0  # stream position of the first buffered sample
        self._pos = 0  # samples received

    @property
    def pos(self) -> int:
        """Samples received so far (16 kHz): the stream position of the next sample."""
        return self._pos

    @property
    def buffered(self) -> int:
        """Samples currently held in the buffer."""
        return self._pos - self._buf_start

    def feed(self, samples: np.ndarray) -> list[TurnEvent]:
        """:meth:`append`, :meth:`detect` and :meth:`endpoint` inline.

        Args:
            samples: float32, shape (n,), 16 kHz mono.
        Returns:
            the turn events these samples complete, in order.
        """
        self.append(samples)
        return self.endpoint(self.detect(samples))

    def append(self, samples: np.ndarray) -> None:
        """Buffer float32 16 kHz samples, shape (n,) (first trimming what is no longer
        needed)."""
        if len(samples) == 0:
            return
        self._trim()
        self._chunks.append(samples)
        self._pos += len(samples)

    def detect(self, samples: np.ndarray) -> np.ndarray:
        """Run the VAD on ``samples`` (the ones just appended): speech probability per
        completed 512-sample window, float32 shape (k,). Touches only the VAD stream, so
        it may run in a worker thread while the loop reads the tracker."""
        if len(samples) <= VAD_PIECE_SAMPLES:
            return self.vad.feed(samples)
        pieces = [self.vad.feed(samples[i : i + VAD_PIECE_SAMPLES])
                  for i in range(0, len(samples), VAD_PIECE_SAMPLES)]
        return np.concatenate(pieces)

    def endpoint(self, probs: np.ndarray) -> list[TurnEvent]:
        """Feed window probabilities (from :meth:`detect`) to the endpointer; return
        the events they cause (sample positions in this stream)."""
        return self.endpointer.feed(probs)

    def finish(self) -> SpeechEnd | None:
        """End the speech in progress now (``input.end``); None if none was confirmed."""
        return self.endpointer.finish()

    def audio(self, start: int, end: int) -> np.ndarray:
        """Buffered samples from stream position ``start`` to ``end`` (clipped to what is
        buffered; float32, shape (≤ end − start,))."""
        if not self._chunks:
            return np.zeros(0, np.float32)
        if len(self._chunks) > 1:
            self._chunks = [np.concatenate(self._chunks)]
        buf = self._chunks[0]
        a = max(0, start - self._buf_start)
        b = max(a, min(len(buf), end - self._buf_start))
        return buf[a:b]

    def since(self, start: int) -> np.ndarray:
        """The audio of speech starting at ``start``: from ``pad_ms`` before it to now."""
        return self.audio(start - self.pad, self._pos)

    def eot_audio(self, start: int, at: int) -> np.ndarray:
        """The end-of-turn model's input for speech that started at ``start``, read up to
        ``at``: from :data:`EOT_PRE_MS` before the speech, at most the last
        :data:`EOT_WINDOW_S` (float32, shape (n,), 16 kHz)."""
        pre = self._eot_pre or 0
        return self.audio(max(start - pre, at - int(EOT_WINDOW_S * RATE)), at)

    def tail_after(self, end: int) -> int:
        """Samples received after speech that ended at ``end``, beyond ``pad_ms`` (the
        silence a turn's transcript leaves out)."""
        return max(0, self._pos - (end + self.pad))

    def _trim(self) -> None:
        """Drop audio nothing can ask for any more: keep the last second, and the pre-roll
        of speech not yet confirmed (amortised: only once the buffer holds twice that)."""
        keep_from = self._pos - PREROLL
        start = self.endpointer.pending_start
        if start is not None and not self.endpointer.in_speech:
            keep_from = min(keep_from, start - self.pad)
        elif start is not None and self._eot_pre is not None:  # the end-of-turn model's input
            keep_from = min(keep_from, max(start - self._eot_pre, self._pos - int(EOT_WINDOW_S * RATE)))
        if keep_from - self._buf_start <= self._pos - keep_from:
            return
        buf = np.concatenate(self._chunks)[max(0, keep_from - self._buf_start) :]
        self._chunks, self._buf_start = [buf], self._pos - len(buf)
