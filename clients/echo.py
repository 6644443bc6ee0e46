"""Echo handling for ``voxpipe mic``: keep the assistant's own voice, played by the speaker
and picked up by the microphone, from reaching the server as the user's speech.

Modes (``voxpipe mic --echo``):

- ``aec``: acoustic echo cancellation — WebRTC's AEC3 (the echo canceller browsers use behind
  ``getUserMedia``), through the ``livekit`` package's ``rtc.AudioProcessingModule``. The
  reference is what the speaker really played (every output block, silence included),
  resampled to 16 kHz; the canceller subtracts its estimated echo from each microphone frame.
  Full duplex once it has learned the room: the user can talk over the reply at any level;
  until then (and whenever its measured echo reduction drops) the half-duplex gate below
  guards its output (:class:`GuardedCanceller`), and so does a level test at the end of each
  reply, where the server can no longer tell its echo from a new turn (:data:`END_S`).
  With headphones (no echo reaches the microphone: :data:`UNHEARD_SHARE`) the microphone
  goes as it is.
  Install with ``pip install "voxpipe[mic]"``.
- ``half-duplex``: while the assistant's audio plays, and for :data:`TAIL_S` after (the
  room's reverberation and the devices' latency), microphone frames are sent as silence
  unless the near-end voice is clearly louder than the echo the playback can cause: a frame
  whose RMS is over the loudest recent playback block's RMS by ``barge_in_db`` (default
  :data:`BARGE_IN_DB`, 6 dB) passes, and the gate stays open :data:`HOLD_S` after it (so a
  barge-in's words are not chopped). The echo is assumed as loud at the microphone as the
  playback signal itself (0 dB coupling: a loud speaker next to the microphone), the worst
  case; a quieter speaker only makes the margin larger.
- ``auto`` (default): ``aec`` when ``livekit`` is installed, else ``half-duplex``.
- ``off``: the microphone as it is (headphones).

Thread model: :meth:`far` runs on the speaker's audio thread, :meth:`near` on the
microphone's; each echo control locks its own state.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Protocol

import numpy as np

from audio.pcm import RATE
from audio.vad_gate import ABS_GATE_DBFS

MODES = ("auto", "aec", "half-duplex", "off")
TAIL_S = 0.3
"""Half-duplex: how long after the last loud playback block the gate stays shut (s)."""
BARGE_IN_DB = 6.0
"""Half-duplex: a microphone frame this much louder (RMS, dB) than the loudest playback block
of the last ``TAIL_S`` + latency passes as the user's voice."""
HOLD_S = 0.5
"""Half-duplex: the gate stays open this long after a frame passed."""
SILENT_DBFS = -50.0
"""Playback quieter than this (RMS, dBFS) is silence: it cannot cause an echo worth gating."""
APM_FRAME = RATE // 100
"""WebRTC's audio processing works on 10 ms frames."""
ERLE_FRAMES, MIN_FRAMES = 150, 25
"""``aec``: the echo handling is judged over the last 150 microphone frames heard during
playback (3 s of 20 ms frames) that are louder than :data:`QUIET_DBFS`, and not before 25 of
them (0.5 s)."""
ERLE_QUANTILE, CONVERGED_DB = 0.9, 15.0
"""``aec``: the canceller has learned the room (converged) when a tenth of those frames or
more had their echo handled: reduced by 15 dB or more, or left under
:data:`~audio.vad_gate.ABS_GATE_DBFS` (below). A converged WebRTC AEC3 takes 25-70 dB out of
a speech echo, one still learning a few dB. A high quantile, not the median: while the user
talks over the reply, frames that hold their voice show little reduction (it is not echo),
but the gaps between their words still show the canceller at work."""
FAINT_DB, COUPLING_QUANTILE = -30.0, 0.9
"""``aec``: a room whose echo reaches the microphone at ``FAINT_DB`` or less under the playback
(dB, the :data:`COUPLING_QUANTILE` quantile of the microphone-over-playback level of frames
that held echo alone) is faint. There AEC3's residual-echo suppressor, which only sees the
playback 25 dB or more over the microphone, takes a voice talking over the reply for echo:
measured on JFK's clip 10 dB over a -35 dB echo of a Piper reply, its output kept the level
within 2-10 dB but Silero VAD called 4 % of its 32 ms windows speech, against 50 % for the
clip alone, 33 % at -20 dB and 26 % at 0 dB (so the bypass below stays off there). The
measured coupling runs 4-6 dB under the room's leak (the playback level it is compared with
is the window's loudest block): -25 dB at -20 dB, -39 dB at -35 dB."""
QUIET_DBFS = ABS_GATE_DBFS
"""``aec``: the server's silence level (-70 dBFS RMS, :data:`audio.vad_gate.ABS_GATE_DBFS`:
its VAD never looks at a quieter window). A microphone frame under it holds no echo worth
judging (a pause in the reply, or a faint leak's quiet syllables) and is not counted; a
canceller output under it is echo handled, however few dB came out: with the speaker heard at
-35 dB, a converged canceller's output is at this level or under it while many of its input
frames are only 5-20 dB over it, so the 15 dB test alone misjudged them."""

LOUD_DBFS, UNHEARD_SHARE, HEARD_SHARE = -30.0, 0.9, 0.5
"""``aec``: the room does not leak (headphones under ``--echo auto``) once 90 % or more of
the last :data:`ERLE_FRAMES` microphone frames heard while the playback was ``LOUD_DBFS``
or louder (its loudest block in the gate's window) were under :data:`QUIET_DBFS` (and
:data:`MIN_FRAMES` of them at least), and until fewer than half were (the user talking
over a reply for 1.5 s, or an echo that appeared: headphones taken off). A room that
carried the playback's echo at -50 dB or more would have put a quarter of them or more
over it. There the canceller learns nothing (there is no echo), so without this the gate,
which assumes an echo as loud as the playback, would stay on for good, and a voice would
need to be 6 dB over the playback's digital level to cut a reply. Measured on the 7
English question clips at Piper's level (-19.5 dBFS RMS), the echo 100 ms late: a share of
0.98-1.0 with no leak and at -60 dB; 0.57-0.75 at -50 dB, 0.15-0.38 at -35, 0-0.14 at -20
and 0 at 0 dB."""

END_S = 1.5
"""How long before its end a reply's echo can reach the server too late for the server to
know it (s): the server takes speech over a reply for what it is (its echo, a backchannel)
only while it believes the client still plays it, and judges that by the time the speech
was confirmed, against a pacing clock that leaves out the client's buffer, the devices'
latency and the echo's path back; its allowance for that path is ``ECHO_LAG_S``
(``pipeline/session/echo_guard.py``), 1.5 s, the value taken here. Speech whose echo starts
later is a new turn to the server, which answers a lone word of it ("Yep." for "...next
step.", 1 run in 20 of ``voxpipe bench echo`` at 0 dB)."""

START_S, START_GAP_S = 2.0, 1.0
"""How long from a reply's start its echo can reach the server as the user going on with
their turn (s): speech that begins within the server's merge window (``merge_window_ms``,
2 s by default) of the user's last speech continues that turn, and a reply starts playing
no sooner than that speech ended; so the echo of its first 2 s can be taken for the user's
words and added to their turn, cutting the reply (``continued``). The server's echo rule
(``pipeline/session/echo_guard.py``) catches it only when the ASR hears the reply's own
words: it heard "That's what I mean." over "That's a nice way to end the story." (1 run in
10 of ``voxpipe bench echo`` at 0 dB, the canceller converged on the reply before). A
reply starts where the playback comes back after ``START_GAP_S`` (1 s) or more of silence
(a new reply; or the same one after an underrun, which moves the echo's delay)."""

VOICE_FRAMES = (3, 5)
"""At a reply's start or end: 3 of the last 5 microphone frames ``barge_in_db`` over the
echo the room makes (a person's syllable, not a stray frame) and the rest of that start or
end is the user's:
passed to its end, with the gaps between their words; a lone frame over it only opens
:data:`HOLD_S`. An echo frame reaches that level only where the measured coupling (a 0.9
quantile) is 6 dB short of the room's, one frame in many."""


class EchoControl(Protocol):
    """What the mic client needs from an echo control."""

    description: str

    def far(self, block: np.ndarray) -> None:
        """A block the speaker just played (int16, shape (n,), at the output rate)."""

    def reply_ends(self, left_s: float) -> None:
        """The reply being played has all arrived: ``left_s`` of it (s) is still to play."""

    def near(self, frame: np.ndarray) -> np.ndarray:
        """A microphone frame (int16, shape (n,), 16 kHz) → the frame to send (same shape)."""
        ...


class EchoUnavailable(RuntimeError):
    """``--echo aec`` without the ``livekit`` package (``pip install "voxpipe[mic]"``)."""


def _rms(x: np.ndarray) -> float:
    """RMS of int16 samples, as a fraction of full scale."""
    if len(x) == 0:
        return 0.0
    return float(np.sqrt(np.mean(np.square(x.astype(np.float32) / 32768.0))))


def _dbfs(x: np.ndarray) -> float:
    """RMS level of int16 samples (dBFS; -180 for digital silence)."""
    return 20 * float(np.log10(_rms(x) + 1e-9))


class NoEchoControl:
    """``--echo off``: the microphone as it is."""

    description = "off — the microphone is sent as it is (use headphones)"

    def far(self, block: np.ndarray) -> None:
        pass

    def reply_ends(self, left_s: float) -> None:
        pass

    def near(self, frame: np.ndarray) -> np.ndarray:
        return frame


class HalfDuplexGate:
    """``--echo half-duplex`` (see the module docstring).

    Args:
        latency_s: the speaker's plus the microphone's stream latency (s): added to
            :data:`TAIL_S`, the span of playback that can still be heard.
        barge_in_db: the margin (dB) a frame needs over the expected echo to pass.
        clock: seconds, monotonic (tests pass their own).
    """

    def __init__(self, latency_s: float = 0.0, barge_in_db: float = BARGE_IN_DB, clock=time.monotonic) -> None:
        self.window_s = TAIL_S + max(0.0, latency_s)
        self.barge_in_db = barge_in_db
        self.ratio = 10 ** (barge_in_db / 20)
        self.description = (f"half-duplex — the microphone is muted while the reply plays (+{TAIL_S * 1000:.0f} ms), "
                            f"except a voice {barge_in_db:g} dB louder than the speaker")
        self._clock = clock
        self._lock = threading.Lock()
        self._blocks: collections.deque[tuple[float, float]] = collections.deque()  # (time, rms)
        self._open_until = 0.0
        self.gated_frames = 0

    def far(self, block: np.ndarray) -> None:
        level = _rms(block)
        if 20 * np.log10(max(level, 1e-9)) < SILENT_DBFS:
            return
        now = self._clock()
        with self._lock:
            self._blocks.append((now, level))

    def reply_ends(self, left_s: float) -> None:
        pass  # the gate guards every reply to its end already

    def now(self) -> float:
        """The gate's clock (s)."""
        return self._clock()

    def expected_echo(self) -> float:
        """The loudest playback block's RMS within the window (0.0: nothing is playing)."""
        now = self._clock()
        with self._lock:
            while self._blocks and self._blocks[0][0] < now - self.window_s:
                self._blocks.popleft()
            return max((lv for _, lv in self._blocks), default=0.0)

    def near(self, frame: np.ndarray) -> np.ndarray:
        echo = self.expected_echo()
        now = self._clock()
        if echo == 0.0 or now < self._open_until:
            return frame
        if _rms(frame) > echo * self.ratio:
            self._open_until = now + HOLD_S
            return frame
        self.gated_frames += 1
        return np.zeros_like(frame)


class WebRtcEchoCanceller:
    """``--echo aec``: WebRTC AEC3 via ``livekit.rtc.AudioProcessingModule`` (see the module
    docstring).

    Args:
        out_rate: the speaker's sample rate (Hz); its blocks are resampled to 16 kHz (soxr).
        delay_ms: the devices' latency (output + input, ms): WebRTC's ``set_stream_delay_ms``
            hint; AEC3 estimates the true echo delay itself.

    Raises:
        EchoUnavailable: ``livekit`` is not installed.
    """

    description = "echo cancellation — WebRTC AEC3 removes the speaker's audio from the microphone"

    def __init__(self, out_rate: int, delay_ms: int = 0) -> None:
        try:
            from livekit import rtc
        except ImportError:
            raise EchoUnavailable('--echo aec needs the livekit package: pip install "voxpipe[mic]"') from None
        import soxr

        self._rtc = rtc
        self._apm = rtc.AudioProcessingModule(echo_cancellation=True, noise_suppression=False,
                                              high_pass_filter=True, auto_gain_control=False)
        self._delay_ms = max(0, int(delay_ms))
        self._resample = soxr.ResampleStream(out_rate, RATE, 1, dtype="int16")
        self._lock = threading.Lock()
        self._far = np.zeros(0, np.int16)

    def reply_ends(self, left_s: float) -> None:
        pass

    def far(self, block: np.ndarray) -> None:
        at16 = self._resample.resample_chunk(np.ascontiguousarray(block, dtype=np.int16))
        with self._lock:
            self._far = np.concatenate([self._far, at16])[-RATE:]  # at most 1 s waits for the microphone

    def near(self, frame: np.ndarray) -> np.ndarray:
        rtc = self._rtc
        with self._lock:
            k = len(self._far) // APM_FRAME * APM_FRAME
            far, self._far = self._far[:k], self._far[k:]
        for i in range(0, k, APM_FRAME):
            self._apm.process_reverse_stream(rtc.AudioFrame(far[i : i + APM_FRAME].tobytes(), RATE, 1, APM_FRAME))
        out = np.array(frame, dtype=np.int16)
        for i in range(0, len(out) - APM_FRAME + 1, APM_FRAME):
            f = rtc.AudioFrame(out[i : i + APM_FRAME].tobytes(), RATE, 1, APM_FRAME)
            self._apm.set_stream_delay_ms(self._delay_ms)
            self._apm.process_stream(f)
            out[i : i + APM_FRAME] = np.frombuffer(f.data, dtype=np.int16)
        return out


class GuardedCanceller:
    """``--echo aec``: the WebRTC canceller, guarded by the half-duplex gate until it works.

    An adaptive canceller needs a second or two of playback to learn the room, and has to
    learn again when the echo's delay moves (a busy machine's audio underruns): meanwhile
    its output still holds the echo, which the server would hear as the user. So while the
    reply plays, each frame whose microphone RMS is over :data:`QUIET_DBFS` is judged: its echo
    is handled when its reduction (microphone RMS over the canceller's output RMS) is
    :data:`CONVERGED_DB` or more, or the output is under :data:`QUIET_DBFS`. While fewer than
    ``1 - ERLE_QUANTILE`` (a tenth) of the last :data:`ERLE_FRAMES` judged frames were handled
    (or fewer than :data:`MIN_FRAMES` were judged), the canceller's output also goes through
    :class:`HalfDuplexGate` (a voice louder than the speaker still passes). Once it is
    converged, the output passes as it is: full duplex; except in a faint room
    (:data:`FAINT_DB`), where a frame :data:`BARGE_IN_DB` over the echo the room makes of the
    playback (the playback's level plus :meth:`coupling_db`) is sent as the microphone heard
    it, and so is everything for :data:`HOLD_S` after it: the user talking over the reply,
    which AEC3's suppressor would blur into non-speech, with an echo at least 6 dB under it
    (the server ignores words that are the reply's: ``pipeline/session/echo_guard.py``).
    Where the playback does not reach the microphone at all (headphones: :attr:`unheard`,
    :data:`UNHEARD_SHARE`), the microphone goes as it is, gate and canceller aside.

    At the start of a reply (its first :data:`START_S` and the gate's window after them) the
    server cannot tell the reply's echo from the user going on with their turn, and at its
    end (:meth:`reply_ends`: its last :data:`END_S` and the gate's window after it, the
    echo's tail) from a new turn, so a converged canceller is not trusted alone there
    either: an output frame it left over
    :data:`QUIET_DBFS` passes only when the microphone heard it ``barge_in_db`` over the echo
    the room makes of the playback (its loudest block in the gate's window plus
    :meth:`coupling_db`, at most 0 dB), or within :data:`HOLD_S` after such a frame (the
    user); else it is echo the canceller failed to take out, and is sent as silence
    (:attr:`residual_frames`). AEC3 converged on a short reply (the first of a session) still
    leaks when the echo's delay moves (a busy machine's playback underruns) or a sound it has
    not yet learned plays: measured on a Piper reply at 0 dB, an echo delay jump of 60 ms 0.65
    s before the end left 190 ms that Silero VAD calls speech in the canceller's output, with
    the guard converged throughout. Over the rest of a reply the server's own guards take such
    a burst for echo or a backchannel.

    Args:
        aec: the canceller.
        gate: the gate (fed the same playback).
    """

    description = ("echo cancellation — WebRTC AEC3 removes the speaker's audio from the microphone "
                   "(half-duplex until it has learned the room)")

    def __init__(self, aec: WebRtcEchoCanceller, gate: HalfDuplexGate) -> None:
        self.aec, self.gate = aec, gate
        self._handled: collections.deque[bool] = collections.deque(maxlen=ERLE_FRAMES)
        self._coupling: collections.deque[float] = collections.deque(maxlen=ERLE_FRAMES)
        self.raw_frames = 0
        """Frames sent as the microphone heard them (a voice over a faint echo)."""
        self._raw_left = 0  # samples still sent raw (the hold)
        self.residual_frames = 0
        """Frames of a converged canceller's output sent as silence at a reply's start or end."""
        self._voice_left = 0  # samples of the canceller's output still passed (the user's hold)
        self._over_bar: collections.deque[bool] = collections.deque(maxlen=VOICE_FRAMES[1])
        self._ending = (0.0, -1.0)  # the reply's end (reply_ends): from, until (the gate's clock, s)
        self._starting = (0.0, -1.0)  # the reply's start: from, until (the gate's clock, s)
        self._last_loud = -START_GAP_S  # when the playback was last louder than SILENT_DBFS (s)
        self._unheard: collections.deque[bool] = collections.deque(maxlen=ERLE_FRAMES)
        self.unheard = False
        """Whether the playback does not reach the microphone at all (:data:`UNHEARD_SHARE`)."""

    def far(self, block: np.ndarray) -> None:
        self.aec.far(block)
        self.gate.far(block)
        if _dbfs(block) >= SILENT_DBFS:
            now = self.gate.now()
            if now - self._last_loud >= START_GAP_S:  # a reply starts: its first START_S are judged
                self._starting = (now, now + START_S + self.gate.window_s)
                self._voice_left = 0
                self._over_bar.clear()
            self._last_loud = now

    def reply_ends(self, left_s: float) -> None:
        """All of the reply has arrived, ``left_s`` of it still to play: its last
        :data:`END_S` (all of it, if shorter) and the gate's window after it are its end."""
        now, left_s = self.gate.now(), max(0.0, left_s)
        self._ending = (now + max(0.0, left_s - END_S), now + left_s + self.gate.window_s)
        self._voice_left = 0
        self._over_bar.clear()

    @property
    def converged(self) -> bool:
        """Whether the canceller handles enough of the echo to trust it alone."""
        n = len(self._handled)
        return n >= MIN_FRAMES and sum(self._handled) >= (1 - ERLE_QUANTILE) * n

    def near(self, frame: np.ndarray) -> np.ndarray:
        clean = self.aec.near(frame)
        echo = self.gate.expected_echo()
        if echo == 0.0:
            return clean
        mic_db, out_db = _dbfs(frame), _dbfs(clean)
        echo_db = 20 * float(np.log10(echo))
        if echo_db >= LOUD_DBFS:
            self._unheard.append(mic_db < QUIET_DBFS)
            n, quiet = len(self._unheard), sum(self._unheard)
            self.unheard = n >= MIN_FRAMES and quiet >= (HEARD_SHARE if self.unheard else UNHEARD_SHARE) * n
        if mic_db >= QUIET_DBFS:
            handled = mic_db - out_db >= CONVERGED_DB or out_db < QUIET_DBFS
            self._handled.append(handled)
            so_far = self.coupling_db()
            # the frame was the reply's echo: how loud the room makes it; but not a voice over
            # the echo that AEC3's suppressor took out (it would raise the bar the voice must pass)
            if handled and (so_far is None or mic_db - echo_db < so_far + BARGE_IN_DB):
                self._coupling.append(mic_db - echo_db)
        if self.unheard:
            return frame  # no echo to take out: the microphone as it is (as --echo off)
        if not self.converged:
            return self.gate.near(clean)
        coupling_db = self.coupling_db()
        if coupling_db is not None and coupling_db <= FAINT_DB and mic_db >= echo_db + coupling_db + BARGE_IN_DB:
            self._raw_left = round(HOLD_S * RATE)
        if self._raw_left > 0:
            self._raw_left -= len(frame)
            self.raw_frames += 1
            return frame
        now = self.gate.now()
        window = next((w for w in (self._ending, self._starting) if w[0] <= now < w[1]), None)
        if window is None:
            return clean
        return self._residual_check(clean, mic_db, out_db, echo_db + min(0.0, coupling_db or 0.0), window[1])

    def _residual_check(self, clean: np.ndarray, mic_db: float, out_db: float, expected_db: float,
                        until: float) -> np.ndarray:
        """At a reply's start or end (judged until ``until``, the gate's clock):
        ``clean`` as it is when the user's (the microphone
        ``barge_in_db`` over ``expected_db``, the echo the room makes, or within
        :data:`HOLD_S` after such a frame, or until ``until`` once :data:`VOICE_FRAMES`
        say the user talks: the pauses between their words are theirs too) or when it holds
        nothing over :data:`QUIET_DBFS`; else silence (echo the canceller left)."""
        over = mic_db >= expected_db + self.gate.barge_in_db
        self._over_bar.append(over)
        if over and sum(self._over_bar) >= VOICE_FRAMES[0]:  # the user talks: theirs to the end
            self._voice_left = max(round(HOLD_S * RATE), round((until - self.gate.now()) * RATE))
        elif over:
            self._voice_left = max(self._voice_left, round(HOLD_S * RATE))
        if self._voice_left > 0:
            self._voice_left -= len(clean)
            return clean
        if out_db < QUIET_DBFS:
            return clean
        self.residual_frames += 1
        return np.zeros_like(clean)

    def coupling_db(self) -> float | None:
        """The room's echo level at the microphone relative to the playback (dB): the
        :data:`COUPLING_QUANTILE` quantile of the microphone-over-playback level (the
        loudest playback block of the gate's window) of the last :data:`ERLE_FRAMES` frames
        the canceller handled (echo alone); None before :data:`MIN_FRAMES` of them."""
        if len(self._coupling) < MIN_FRAMES:
            return None
        return float(np.quantile(self._coupling, COUPLING_QUANTILE))


def aec_available() -> bool:
    """Whether ``--echo aec`` can run here (``livekit`` imports)."""
    try:
        import livekit.rtc  # noqa: F401
    except ImportError:
        return False
    return True


def make_echo_control(mode: str, *, out_rate: int, latency_s: float = 0.0,
                      barge_in_db: float = BARGE_IN_DB) -> EchoControl:
    """The echo control for ``--echo MODE`` (one of :data:`MODES`).

    Raises:
        EchoUnavailable: ``aec`` without ``livekit``.
        ValueError: an unknown mode.
    """
    if mode == "auto":
        mode = "aec" if aec_available() else "half-duplex"
    if mode == "aec":
        return GuardedCanceller(WebRtcEchoCanceller(out_rate, round(latency_s * 1000)),
                                HalfDuplexGate(latency_s, barge_in_db))
    if mode == "half-duplex":
        return HalfDuplexGate(latency_s, barge_in_db)
    if mode == "off":
        return NoEchoControl()
    raise ValueError(f"--echo {mode!r}: use one of {', '.join(MODES)}")
