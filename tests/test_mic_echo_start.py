"""``voxpipe mic --echo aec`` at the start of a reply (issue 36's self-cut reply at 0 dB).

Speech that begins within the server's merge window of the user's last speech continues
their turn, so the echo of a reply's first seconds that a converged canceller lets through
is added to the user's words and cuts the reply (``clients.echo.START_S``). Real speech
through the real WebRTC AEC3 and its guard, the speaker heard at 0 dB: the canceller learns
the room on a first reply; the echo's delay then grows by 60 ms (a busy machine's playback
underran: ``tests.test_mic_echo_end.JUMP_MS``) before a second reply, whose start it leaks
while its guard still counts it converged."""

from __future__ import annotations

import numpy as np
import pytest

import clients.echo
from clients.echo import QUIET_DBFS, START_GAP_S, START_S, GuardedCanceller, HalfDuplexGate
from tests.test_mic_echo_end import _clip, _frames_db, _heard, _play

pytest.importorskip("livekit.rtc")

FIRST_S, GAP_S, SECOND_S = 3.0, 2.0, 3.0
"""The first reply, the user's turn between (the speaker silent), the second reply (s)."""


def _run(audio_dir, voice: np.ndarray | None = None, voice_at_s: float = 0.0):
    """Both replies (LJSpeech, 24 kHz) played and heard at 0 dB, in 20 ms steps with 1 s
    after them; ``voice`` (16 kHz) added to the microphone from ``voice_at_s`` after the
    second reply's start. Returns the guard, the canceller's own output and the guard's
    output (16 kHz float), and where the second reply starts (a sample index at 16 kHz)."""
    steps = round((FIRST_S + GAP_S + SECOND_S + 1.0) / 0.02)
    far24 = np.zeros(steps * 480, np.float32)
    clip = _clip(audio_dir, "en_ljspeech_LJ001-0007.wav", 24000)
    a, b = round((FIRST_S + GAP_S) * 24000), round(SECOND_S * 24000)
    far24[: round(FIRST_S * 24000)] = clip[: round(FIRST_S * 24000)]
    far24[a : a + b] = clip[-b:]  # a different stretch of speech
    second = round((FIRST_S + GAP_S) * 16000)
    mic = _heard(far24, second, voice, second + round(voice_at_s * 16000))
    guard, raw, out, converged = _play(far24, mic)
    assert converged[second // 320 :] == [True] * (steps - second // 320)  # trusted on the second reply
    return guard, raw, out, second


def test_a_converged_canceller_leaks_at_a_replys_start_and_the_leak_is_not_sent(audio_dir, monkeypatch):
    start = slice(None)
    with monkeypatch.context() as m:
        m.setattr(clients.echo, "START_S", 0.0)  # no check at the start: what the server got
        m.setattr(clients.echo, "START_GAP_S", float("inf"))
        guard, raw, out, second = _run(audio_dir)
        start = slice(second, second + round(START_S * 16000))
        leak = _frames_db(raw[start])
        assert (leak > -45).sum() >= 10 and leak.max() > -30  # the echo, barely reduced, for 0.2 s or more
        assert np.array_equal(out[start], raw[start])  # sent as it is
    guard, raw, out, second = _run(audio_dir)
    assert (_frames_db(raw[start]) > -45).sum() >= 10  # the same leak
    assert _frames_db(out[start]).max() < QUIET_DBFS  # nothing the server's VAD would even look at
    assert guard.residual_frames >= 10


def test_a_voice_over_the_echo_at_a_replys_start_still_passes(audio_dir):
    """JFK 10 dB over the echo (the bench's barge-in level), from 0.5 s into the second
    reply (a person going on with their turn): less than 6 dB of it lost."""
    reply = _clip(audio_dir, "en_ljspeech_LJ001-0007.wav", 16000)[: round(SECOND_S * 16000)]
    voice = _clip(audio_dir, "en_jfk_inaugural_1961.wav", 16000)[: 16000 * 2]
    voice *= np.sqrt(np.mean(reply**2) / np.mean(voice**2)) * 10 ** (10 / 20)
    guard, _, out, second = _run(audio_dir, voice=voice, voice_at_s=0.5)
    a = second + 8000
    got = out[a : a + len(voice)]
    lost_db = 10 * np.log10(np.mean(voice**2) / np.mean(got**2))
    assert lost_db < 6, lost_db


def test_a_reply_starts_after_a_second_of_silence_and_its_start_lasts_start_s():
    """A converged canceller (a stand-in taking 30 dB out: -42 dBFS left of a -12 dBFS echo):
    its output is judged for ``START_S`` and the gate's window from where the playback
    starts, not after a pause shorter than ``START_GAP_S``, and again after a longer one."""
    from tests.test_mic_cli import _Canceller, _frame

    now = [0.0]
    gate = HalfDuplexGate(0.0, clock=lambda: now[0])
    guard = GuardedCanceller(_Canceller(30.0), gate)  # type: ignore[arg-type]
    echo, silence = _frame(-12.0), np.zeros(320, np.int16)

    def step(t: float, played: np.ndarray) -> bool:
        """Play ``played`` at ``t``, hear its echo: whether the canceller's output was sent."""
        now[0] = t
        guard.far(played)
        return bool(guard.near(echo if played.any() else silence).any())

    def reply(t: float, n: int) -> list[bool]:
        return [step(t + i * 0.02, echo) for i in range(n)]

    def pause(t: float, s: float) -> float:
        for i in range(round(s / 0.02)):
            step(t + i * 0.02, silence)
        return t + round(s / 0.02) * 0.02

    until = round((START_S + gate.window_s) / 0.02)
    sent = reply(0.0, 200)  # 4 s of a reply
    assert guard.converged and not any(sent[:until]) and all(sent[until + 1 :])
    t = pause(4.0, START_GAP_S - 0.2)  # a short pause: the same reply
    assert all(reply(t, 50))
    sent = reply(pause(t + 1.0, START_GAP_S + 0.2), 200)  # a longer one: a new reply starts
    assert not any(sent[:until]) and all(sent[until + 1 :])
