"""Streaming PCM decoding: declared wire format → 16 kHz mono float32.

The client declares ``sample_rate``, ``format`` (``pcm16`` little-endian signed 16-bit or
``f32`` little-endian IEEE float) and ``channels`` in ``session.start``. Binary frames
may have any length: bytes that do not complete a frame (one sample for every channel)
are carried over to the next call. Resampling uses soxr's streaming resampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import soxr

RATE = 16000
"""The pipeline's sample rate (Hz): every stage takes 16 kHz mono, as Whisper and Silero VAD
expect. (The OpenAI Realtime API's 24 kHz is :data:`server.realtime.types.REALTIME_RATE`.)"""

SAMPLE_WIDTH = {"pcm16": 2, "f32": 4}
"""Bytes per sample for each wire format."""
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
"""The rates an Opus encoder takes and a decoder gives (Hz, RFC 6716 §2): an Opus stream
declares one of them (:mod:`audio.opus`)."""


class AudioFormatError(ValueError):
    """Audio bytes that cannot be in the declared format (e.g. PCM16 sent as f32)."""


@dataclass(frozen=True, slots=True)
class PcmFormat:
    """A declared wire format.

    Attributes:
        sample_rate: samples per second per channel (Hz), 8000–48000.
        format: ``"pcm16"`` or ``"f32"`` (little-endian).
        channels: 1 (mono) or 2 (interleaved stereo).
    """

    sample_rate: int
    format: str
    channels: int

    def __post_init__(self) -> None:
        if self.format not in SAMPLE_WIDTH:
            raise ValueError(f"format must be one of {sorted(SAMPLE_WIDTH)}, got {self.format!r}")
        if not 8000 <= self.sample_rate <= 48000:
            raise ValueError(f"sample_rate must be 8000..48000 Hz, got {self.sample_rate}")
        if self.channels not in (1, 2):
            raise ValueError(f"channels must be 1 or 2, got {self.channels}")

    @property
    def frame_bytes(self) -> int:
        """Bytes in one frame (one sample for each channel)."""
        return SAMPLE_WIDTH[self.format] * self.channels


MIN_EVIDENCE = 64
"""Telling 32-bit words needed before the format check decides anything."""

TINY_F32 = 1e-7
"""Words that read as float32 of magnitude up to this tell nothing: quiet PCM16 read as
float32 is tiny (its high sample small and positive), and so is float32 near silence (a
resampler's ringing after digital silence, ~1e-11)."""


def _telling(data: bytes) -> np.ndarray:
    """The 32-bit words of ``data`` read as float32, less those that tell nothing about the
    format: zeros (the same in both formats) and tiny values (:data:`TINY_F32`)."""
    n = len(data) // 4
    x = np.frombuffer(data[: n * 4], dtype="<f4")
    return x[~(np.isfinite(x) & (np.abs(x) <= TINY_F32))]


def f32_evidence(data: bytes) -> int:
    """Number of 32-bit words in ``data`` that tell float32 from PCM16 (what
    :func:`looks_like_f32` judges)."""
    return len(_telling(data))


def looks_like_f32(data: bytes) -> bool:
    """True if ``data`` reads as plausible float32 audio in [-1, 1].

    Real PCM16 audio read as float32 gives mostly non-finite, huge or tiny values, so this
    separates the two formats on a few hundred bytes. Only telling words count (not zeros,
    which read the same in both formats, nor tiny values, which quiet audio of either gives),
    and fewer than :data:`MIN_EVIDENCE` of them decide nothing (False): near-silent PCM16 —
    zeros and ±1 dither — is never mistaken for float32, and float32 that starts near silence
    is judged on its first real sound, not on its silence.
    """
    if len(data) // 4 < 16:
        return False
    x = _telling(data)
    if len(x) < MIN_EVIDENCE:
        return False
    ok = np.isfinite(x) & (np.abs(x) <= 1.0)
    return bool(ok.mean() > 0.98)


class PcmDecoder:
    """Decode a stream of wire bytes into 16 kHz mono float32 samples.

    Args:
        fmt: the declared input format.

    ``feed(bytes) -> np.ndarray[float32]`` returns whatever 16 kHz samples are ready;
    ``flush()`` returns the resampler's tail and drops a trailing partial frame.
    Raises :class:`AudioFormatError` when the bytes cannot be in the declared format:
    f32 samples outside [-4, 4] or non-finite, or PCM16 that reads as clean float32.
    The mismatch is latched: every later ``feed`` raises it again without decoding
    (the stream is in the wrong format; a new decoder is needed).
    """

    def __init__(self, fmt: PcmFormat) -> None:
        self.fmt = fmt
        self._carry = b""
        self._checked = False
        self.error: AudioFormatError | None = None  # the latched format mismatch
        self._resampler = self._new_resampler()

    def _new_resampler(self) -> soxr.ResampleStream | None:
        if self.fmt.sample_rate == RATE:
            return None
        return soxr.ResampleStream(self.fmt.sample_rate, RATE, 1, dtype="float32", quality="HQ")

    def feed(self, data: bytes) -> np.ndarray:
        """Decode ``data`` (any length); returns float32 samples at 16 kHz, shape (n,)."""
        if self.error is not None:
            raise self.error
        try:
            return self._feed(data)
        except AudioFormatError as exc:
            self.error = exc
            raise

    def _feed(self, data: bytes) -> np.ndarray:
        buf = self._carry + bytes(data)
        usable = len(buf) - len(buf) % self.fmt.frame_bytes
        self._carry = buf[usable:]
        if usable == 0:
            return np.zeros(0, dtype=np.float32)
        raw = buf[:usable]
        if not self._checked and len(raw) >= 512:
            self._check(raw)  # until the audio has enough non-zero samples to judge
        if self.fmt.format == "pcm16":
            x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
        else:
            x = np.frombuffer(raw, dtype="<f4").astype(np.float32)
            if not np.all(np.isfinite(x)) or np.max(np.abs(x)) > 4.0:
                raise AudioFormatError(
                    "audio is not float32 in [-1, 1]: declared format 'f32' does not match the data"
                )
        if self.fmt.channels == 2:
            x = x.reshape(-1, 2).mean(axis=1)
        return self._resample(x, last=False)

    def flush(self) -> np.ndarray:
        """End of stream (``input.end``): drop any partial frame and return the resampler's
        tail. More audio may follow (the next turn on the same socket): it starts a fresh
        resampler (soxr's stream takes no input after its last chunk)."""
        self._carry = b""
        tail = self._resample(np.zeros(0, dtype=np.float32), last=True)
        self._resampler = self._new_resampler()
        return tail

    def _check(self, raw: bytes) -> None:
        if self.fmt.format != "pcm16":
            self._checked = True
            return
        head = raw[:4096]
        self._checked = f32_evidence(head) >= MIN_EVIDENCE
        if self._checked and looks_like_f32(head):
            raise AudioFormatError(
                "audio looks like float32 but 'pcm16' was declared: send format 'f32'"
            )

    def _resample(self, x: np.ndarray, *, last: bool) -> np.ndarray:
        if self._resampler is None:
            return np.ascontiguousarray(x, dtype=np.float32)
        return self._resampler.resample_chunk(x, last=last).astype(np.float32, copy=False)


def float_to_pcm16(x: np.ndarray) -> bytes:
    """float32 samples in [-1, 1], shape (n,) → little-endian PCM16 bytes (clipped)."""
    return np.rint(np.clip(x, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def resample(x: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample a whole float32 mono signal (soxr HQ); returns float32, shape (m,)."""
    if src_rate == dst_rate:
        return np.asarray(x, dtype=np.float32)
    return soxr.resample(np.asarray(x, dtype=np.float32), src_rate, dst_rate, quality="HQ").astype(np.float32)
