"""``voxpipe mic --echo aec`` at the end of a reply (issue 36's last self-answered turn).

The server can no longer tell the echo of a reply's last stretch from a new turn
(``clients.echo.END_S``), so there the client must not pass a converged canceller's leak.
Real speech through the real WebRTC AEC3 and its guard, the speaker heard at 0 dB: a jump
of the echo's delay late in a short reply (a busy machine's playback underrun) makes the
canceller leak the echo as it is, while its guard still counts it converged."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest

import audio.devices
import clients.echo
import clients.mic
from clients.echo import QUIET_DBFS, GuardedCanceller, HalfDuplexGate, NoEchoControl, WebRtcEchoCanceller, _dbfs
from tests.fake_audio import FakeSoundDevice, Room
from tests.fakes import FakeLlm, FakeTts, LlmReply, fake_engines
from tests.test_mic_cli import TONE_HZ, _ask, _talk

pytest.importorskip("livekit.rtc")

REPLY_S = 2.0
"""A short reply (the first of a session: the canceller has learned the room on it alone)."""
DELAY_MS = 100
"""The echo's delay (speaker output to microphone)."""
JUMP_S, JUMP_MS = 0.6, 60
"""The echo's delay grows by 60 ms 0.6 s before the reply's end (the speaker's stream underran)."""


@pytest.fixture(autouse=True)
def _no_start_check(monkeypatch):
    """A reply's start has a check of its own (``tests/test_mic_echo_start.py``), which would
    cover all of these short replies: left out here."""
    monkeypatch.setattr(clients.echo, "START_S", 0.0)
    monkeypatch.setattr(clients.echo, "START_GAP_S", float("inf"))  # nor a new one after a jump of the clock


def _clip(audio_dir, name: str, rate: int) -> np.ndarray:
    import soxr

    from audio.wav import read_audio

    x, r = read_audio(str(audio_dir / name))
    return soxr.resample(x if x.ndim == 1 else x.mean(1), r, rate).astype(np.float32)


def _heard(far24: np.ndarray, jump: int, voice: np.ndarray | None = None, voice_at: int = 0) -> np.ndarray:
    """What the microphone hears (16 kHz float) of ``far24`` played at 24 kHz at 0 dB:
    :data:`DELAY_MS` late, and :data:`JUMP_MS` later again from sample ``jump`` (16 kHz) on;
    plus ``voice`` (16 kHz) from sample ``voice_at``."""
    import soxr

    far16 = soxr.resample(far24, 24000, 16000).astype(np.float32)
    d, dj = DELAY_MS * 16, JUMP_MS * 16
    mic = np.zeros(len(far24) // 480 * 320, np.float32)
    mic[d:jump] = far16[: jump - d]
    mic[jump:] = far16[jump - d - dj : len(mic) - d - dj]
    if voice is not None:
        mic[voice_at : voice_at + len(voice)] += voice[: len(mic) - voice_at]
    return mic


def _play(far24: np.ndarray, mic: np.ndarray, *, ends_s: float | None = None):
    """``far24`` played and ``mic`` heard through a guarded WebRTC AEC3, in 20 ms steps on
    the audio's clock; ``ends_s``: the client says at the start that all of the reply has
    arrived with that much to play. Returns the guard, the canceller's own output and the
    guard's output (16 kHz float), and the guard's ``converged`` after each step."""
    now = [0.0]
    guard = GuardedCanceller(WebRtcEchoCanceller(24000, delay_ms=DELAY_MS),
                             HalfDuplexGate(DELAY_MS / 1000, clock=lambda: now[0]))
    raw: list[np.ndarray] = []
    inner = guard.aec.near
    guard.aec.near = lambda f: raw.append(inner(f)) or raw[-1]  # type: ignore[method-assign]
    if ends_s is not None:
        guard.reply_ends(ends_s)
    out, converged = [], []
    for i in range(len(mic) // 320):
        now[0] = i * 0.02
        guard.far((far24[i * 480 : (i + 1) * 480] * 32767).astype(np.int16))
        out.append(guard.near((mic[i * 320 : (i + 1) * 320] * 32767).astype(np.int16)))
        converged.append(guard.converged)
    return guard, np.concatenate(raw) / 32768, np.concatenate(out) / 32768, converged


def _run(audio_dir, *, ends: bool, voice: np.ndarray | None = None, voice_at_s: float = 0.0):
    """The reply (LJSpeech, 24 kHz) played and heard at 0 dB with the delay jump, in 20 ms
    steps with 1 s after it; ``ends``: the client says at the start that all of it has
    arrived; ``voice`` (16 kHz) added to the microphone from ``voice_at_s``. Returns the
    guard, the canceller's own output and the guard's output (16 kHz float), and where the
    jump is heard (a sample index)."""
    steps = round(REPLY_S / 0.02) + 50
    far24 = np.zeros(steps * 480, np.float32)
    reply = _clip(audio_dir, "en_ljspeech_LJ001-0007.wav", 24000)[: round(REPLY_S * 24000)]
    far24[: len(reply)] = reply
    jump = round((REPLY_S - JUMP_S) * 16000)
    mic = _heard(far24, jump, voice, round(voice_at_s * 16000))
    guard, raw, out, converged = _play(far24, mic, ends_s=REPLY_S if ends else None)
    assert converged[jump // 320 :] == [True] * (steps - jump // 320)  # trusted from before the jump on
    return guard, raw, out, jump


def _frames_db(x: np.ndarray) -> np.ndarray:
    return np.array([_dbfs((x[i : i + 320] * 32768).astype(np.int16)) for i in range(0, len(x) - 319, 320)])


def test_a_converged_canceller_leaks_at_a_replys_end_and_the_leak_is_not_sent(audio_dir):
    guard, raw, out, jump = _run(audio_dir, ends=False)
    leak = _frames_db(raw[jump:])
    assert (leak > -45).sum() >= 10 and leak.max() > -25  # the echo, barely reduced, for 0.2 s or more
    assert np.array_equal(out[jump:], raw[jump:])  # without reply_ends: sent as it is (the server heard "Yep.")
    guard, raw, out, jump = _run(audio_dir, ends=True)
    assert (_frames_db(raw[jump:]) > -45).sum() >= 10  # the same leak
    assert _frames_db(out[jump:]).max() < QUIET_DBFS  # nothing the server's VAD would even look at
    assert guard.residual_frames >= 10


def test_a_voice_over_the_echo_at_a_replys_end_still_passes(audio_dir):
    """JFK 10 dB over the echo (the bench's barge-in level), from 1 s before the reply's end:
    less than 6 dB of it lost where it overlaps the end, and after the reply's end."""
    reply = _clip(audio_dir, "en_ljspeech_LJ001-0007.wav", 16000)[: round(REPLY_S * 16000)]
    voice = _clip(audio_dir, "en_jfk_inaugural_1961.wav", 16000)[: 16000 * 2]
    voice *= np.sqrt(np.mean(reply**2) / np.mean(voice**2)) * 10 ** (10 / 20)
    start = REPLY_S - 1.0
    guard, _, out, _ = _run(audio_dir, ends=True, voice=voice, voice_at_s=start)
    a = round(start * 16000)
    got = out[a : a + len(voice)]
    lost_db = 10 * np.log10(np.mean(voice**2) / np.mean(got**2))
    assert lost_db < 6, lost_db


async def test_the_client_says_when_a_reply_has_all_arrived(monkeypatch):
    """Orchestration (a fake room, no echo): ``response.done`` of a reply with audio tells
    the echo control how much of it is still to play."""
    r = Room()
    monkeypatch.setattr(audio.devices, "_sd", lambda: FakeSoundDevice(r))
    told: list[float] = []

    class Recording(NoEchoControl):
        def reply_ends(self, left_s: float) -> None:
            told.append(left_s)

    monkeypatch.setattr(clients.mic, "make_echo_control", lambda *a, **k: Recording())
    engines = fake_engines(llm=FakeLlm(default=LlmReply.of("A reply that is long enough to hear.")),
                           tts=FakeTts(s_per_char=0.03, hz=TONE_HZ))

    async def script(room: Room, out: io.StringIO) -> None:
        await _ask(room, out)
        await asyncio.sleep(0.2)

    await _talk(engines, r, script)
    audio_s = len("A reply that is long enough to hear.") * 0.03
    assert len(told) == 1 and 0.0 < told[0] <= audio_s + 0.1, told


def test_only_a_replys_last_seconds_and_its_tail_are_judged():
    """A converged canceller (a stand-in taking 30 dB out: -42 dBFS left of a -12 dBFS echo)
    during a 5 s reply: its output is trusted until the last ``END_S``; then what it left is
    silence, a voice 9 dB over the echo and the hold after it pass; after the tail, trusted."""
    from clients.echo import END_S, HOLD_S
    from tests.test_mic_cli import _Canceller, _frame

    now = [0.0]
    gate = HalfDuplexGate(0.0, clock=lambda: now[0])
    guard = GuardedCanceller(_Canceller(30.0), gate)  # type: ignore[arg-type]
    echo, voice = _frame(-12.0), _frame(-3.0)

    def near(t: float, frame: np.ndarray) -> np.ndarray:
        now[0] = t
        guard.far(_frame(-12.0))  # the reply plays on
        return guard.near(frame)

    for i in range(30):
        near(i * 0.02, echo)
    assert guard.converged
    now[0] = 0.0
    guard.reply_ends(5.0)  # all of it has arrived (at 0 s): 5 s to play
    assert np.array_equal(near(5.0 - END_S - 0.1, echo), guard.aec.near(echo))  # before its end: trusted
    assert not near(5.0 - END_S + 0.1, echo).any()  # its end: the residual is not sent
    assert np.array_equal(near(4.0, voice), guard.aec.near(voice))  # the user
    hold = round(HOLD_S / 0.02)
    for i in range(1, hold):  # and the hold after it
        assert np.array_equal(near(4.0 + i * 0.02, echo), guard.aec.near(echo))
    assert not near(4.0 + hold * 0.02, echo).any()
    assert np.array_equal(near(5.0 + gate.window_s + 0.01, echo), guard.aec.near(echo))  # a new reply plays
    assert guard.residual_frames == 2


def test_a_voice_that_goes_on_holds_the_replys_end_to_its_end():
    """Three frames of a voice over the echo at a reply's end and the rest of that end is the
    user's, the quiet frames between their words included; a lone loud frame holds
    ``HOLD_S`` only."""
    from clients.echo import HOLD_S
    from tests.test_mic_cli import _Canceller, _frame

    now = [0.0]
    gate = HalfDuplexGate(0.0, clock=lambda: now[0])

    def fresh() -> GuardedCanceller:
        guard = GuardedCanceller(_Canceller(30.0), gate)  # type: ignore[arg-type]
        for i in range(30):
            now[0] = i * 0.02
            guard.far(_frame(-12.0))
            guard.near(_frame(-12.0))
        assert guard.converged
        now[0] = 0.0
        guard.reply_ends(1.0)  # all of it its end (END_S is longer), then the gate's window
        return guard

    def near(guard: GuardedCanceller, t: float, frame: np.ndarray) -> np.ndarray:
        now[0] = t
        guard.far(_frame(-12.0))
        return guard.near(frame)

    voice, lull = _frame(-3.0), _frame(-12.0)  # a lull: what the canceller leaves is over -70 dBFS
    lone = fresh()
    near(lone, 0.0, voice)
    hold = round(HOLD_S / 0.02)
    assert [near(lone, i * 0.02, lull).any() for i in range(1, hold + 1)] == [True] * (hold - 1) + [False]
    talking = fresh()
    for i in range(3):
        near(talking, i * 0.02, voice)
    end = 1.0 + gate.window_s
    assert all(near(talking, t, lull).any() for t in np.arange(0.1, end - 0.02, 0.02))
    assert talking.residual_frames == 0
