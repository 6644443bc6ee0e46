"""``voxpipe mic`` over the real server (tests/fake_server.py: fake stages), with the audio
devices faked at the ``sounddevice`` boundary (tests/fake_audio.py: real-time streams into a
simulated room) — what the user sees, echo handling, devices, start-up failures, Ctrl+C and
a server that goes away. The real-device version (PulseAudio, real models) is
tests/test_mic_loopback.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import audio.devices
from clients.echo import HOLD_S, GuardedCanceller, HalfDuplexGate, NoEchoControl, WebRtcEchoCanceller
from clients.mic import EXIT_GONE, Console, ReplyView, _session, run_mic
from clients.mic_console import latency_line
from clients.mic_wire import OUT_RATE
from pipeline.config import ToolsConfig, VoxpipeConfig
from pipeline.engines import open_tools
from tests.conftest import ROOT, free_port
from tests.fake_audio import FakeSoundDevice, Room
from tests.fake_server import fake_server, fake_server_thread
from tests.fakes import FakeEot, FakeLlm, FakeTts, LlmReply, fake_engines, noise, silence, tone

DEADLINE_S = 60.0
TONE_HZ = 300.0
"""The fake voice's pitch: a tone, not a constant level (Opus, the mic's default codec, drops DC)."""


def _voxpipe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture
def room(monkeypatch) -> Room:
    """A fake sounddevice with no echo; the room is returned to speak into."""
    r = Room()
    monkeypatch.setattr(audio.devices, "_sd", lambda: FakeSoundDevice(r))
    return r


async def _until(pred, what: str, out: io.StringIO | None = None) -> None:
    for _ in range(int(DEADLINE_S / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"{what} not seen; the client said:\n{out.getvalue() if out else ''}")


async def _talk(engines, room: Room, script, *, echo: str = "off", live: bool = False,
                turn: dict | None = None, cfg: VoxpipeConfig | None = None, codec: str = "auto") -> str:
    """Run the mic client against the real server over ``engines`` (and ``cfg``);
    ``script(room, out)`` plays the human's part; returns what the client printed."""
    out = io.StringIO()
    console = Console(out, live=live)
    stop = asyncio.Event()
    async with fake_server(cfg, engines=engines) as srv:
        task = asyncio.create_task(_session(srv.ws, None, None, console, echo=echo, stop=stop, turn=turn,
                                            codec=codec))
        await _until(lambda: "listening —" in out.getvalue() or task.done(), "the client listening", out)
        await script(room, out)
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
    return out.getvalue()


async def _ask(room: Room, out: io.StringIO, n: int = 1) -> None:
    """Say 1.5 s of words, then wait for the n-th reply's latency line."""
    room.say(np.concatenate([tone(1500), silence(10)]))
    await _until(lambda: out.getvalue().count("latency:") >= n, "the reply", out)


# ---- what the user sees ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["auto", "pcm"])  # auto: Opus both ways (the server has it)
async def test_a_turn_shows_state_partials_the_reply_as_played_and_latency(room, codec, caplog):
    engines = fake_engines(llm=FakeLlm(default=LlmReply.of("Sure, ", "here it is. ", "And one more thing.")),
                           tts=FakeTts(s_per_char=0.04, hz=TONE_HZ))
    with caplog.at_level(logging.INFO, logger="pipeline.session.session"):
        text = await _talk(engines, room, _ask, codec=codec)
    wire = "opus" if codec == "auto" else "pcm16"
    assert any(f"audio in {wire} at 16000 Hz, out {wire} at {OUT_RATE} Hz" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    lines = text.splitlines()
    assert lines[0].startswith("voxpipe mic: echo: off")
    i = lines.index("[you're speaking]")
    assert lines[i + 1].startswith("  ... alpha")  # partials as they arrive, before the final
    you = next(k for k, ln in enumerate(lines) if ln.startswith("you: "))
    assert i < you and lines[you].startswith("you: alpha bravo charlie")
    assert lines.index("[thinking]") < lines.index("[speaking]")
    said = [ln for ln in lines if ln.startswith("voxpipe: ")]
    # one line per phrase as it is played, not the whole reply at once
    assert said == ["voxpipe: Sure,", "voxpipe: here it is.", "voxpipe: And one more thing."], text
    lat = next(ln for ln in lines if "latency:" in ln)
    assert lat.startswith("  latency: voice-to-voice ") and "first audio" in lat
    assert lines[-1] == "[listening]"
    assert room.played_seconds(OUT_RATE) > 1.0  # the reply's audio was played


async def test_against_a_server_without_opus_the_mic_falls_back_to_pcm(room):
    # a server of before Opus: session.start with format "opus" is a bad_event
    from websockets.asyncio.server import serve

    starts: list[dict] = []
    frames: list[int] = []

    async def old_server(ws) -> None:
        async for msg in ws:
            if isinstance(msg, bytes):
                frames.append(len(msg))
                continue
            ev = json.loads(msg)
            if ev["type"] == "session.start":
                starts.append(ev)
                if ev.get("format") == "opus" or ev.get("output_format", "pcm16") != "pcm16":
                    await ws.send(json.dumps({"type": "error", "code": "bad_event", "fatal": False,
                                              "message": "invalid session.start: format: Input should be 'pcm16' "
                                                         "or 'f32'"}))
                else:
                    fmt = {"sample_rate": ev["sample_rate"], "format": "pcm16", "channels": 1}
                    await ws.send(json.dumps({"type": "session.started", "session_id": "old", "protocol": 1,
                                              "input": fmt, "output": {**fmt, "sample_rate": 24000}}))

    out = io.StringIO()
    stop = asyncio.Event()
    async with serve(old_server, "127.0.0.1", 0) as srv:
        port = srv.sockets[0].getsockname()[1]
        task = asyncio.create_task(_session(f"ws://127.0.0.1:{port}/ws", None, None, Console(out), stop=stop))
        await _until(lambda: len(frames) >= 25 or task.done(), "half a second of microphone frames", out)
        stop.set()
        await asyncio.wait_for(task, DEADLINE_S)
    assert [s.get("format") for s in starts] == ["opus", "pcm16"], starts
    assert set(frames) == {640}, frames  # 20 ms of PCM16 at 16 kHz each, and nothing before session.started


async def test_on_a_terminal_the_status_line_is_rewritten_in_place(room):
    text = await _talk(fake_engines(), room, _ask, live=True)
    assert "\r\x1b[2K[listening]" in text and "\r\x1b[2K[you're speaking] alpha" in text
    assert "\r\x1b[2K[speaking]" in text and "voxpipe: Okay.\n" in text
    assert "\n[" not in text  # no state on a line of its own: the status line is rewritten


async def test_a_reply_cut_by_barge_in_shows_the_spoken_part(room):
    long = "One two three four five six seven eight nine ten. " * 4
    engines = fake_engines(llm=FakeLlm(default=LlmReply.of(long)), tts=FakeTts(s_per_char=0.03, hz=TONE_HZ))

    async def script(r: Room, out: io.StringIO) -> None:
        r.say(np.concatenate([tone(1500), silence(10)]))
        await _until(lambda: "[speaking]" in out.getvalue(), "the reply playing", out)
        await asyncio.sleep(2.5)  # past the merge window: a new turn, not the same one going on
        r.say(tone(1500))  # the user talks over it
        await _until(lambda: "(interrupted" in out.getvalue(), "the cut", out)

    text = await _talk(engines, room, script)
    cut = next(ln for ln in text.splitlines() if "(interrupted" in ln)
    assert cut.endswith("(interrupted: you talked over it)")
    spoken = cut.removeprefix("voxpipe: ").removesuffix("(interrupted: you talked over it)").strip()
    assert long.startswith(spoken) and len(spoken) < len(long.strip())  # only what was spoken
    assert room.played_seconds(OUT_RATE) < len(long) * 0.03 - 1  # the rest was not played


async def test_tool_calls_and_their_results_get_a_line_each_as_they_happen(room):
    """The model calls the calculator, then a tool that raises: a line for each call and
    each result (the error said as one), in order, while the reply is made; the rest as before."""
    block = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n</tool_call>'
    bad = '<tool_call>\n{"name": "explode", "arguments": {"reason": "on purpose"}}\n</tool_call>'
    llm = FakeLlm([LlmReply.of("Let me see. ", block), LlmReply.of(bad), LlmReply.of("It is 42.")])
    cfg = VoxpipeConfig(tools=ToolsConfig(plugin="tests.tool_plugins:TOOLS", builtin=("calculator",)))
    engines = fake_engines(llm=llm, tts=FakeTts(s_per_char=0.02, hz=TONE_HZ), tools=open_tools(cfg))
    text = await _talk(engines, room, _ask, cfg=cfg)
    lines = text.splitlines()
    tools = [ln for ln in lines if ln.startswith("  tool")]  # in order (phrases played may come between)
    assert len(tools) == 4 and tools[0] == '  tool: calculate(expression="6*7")', text
    assert re.fullmatch(r'  tool: calculate -> \{"result": 42\} \(\d+ ms\)', tools[1]), text
    assert tools[2] == '  tool: explode(reason="on purpose")', text
    assert re.fullmatch(r"  tool error: explode failed: RuntimeError: exploded on purpose \(\d+ ms\)", tools[3])
    i = lines.index(tools[0])
    said = [ln for ln in lines if ln.startswith("voxpipe: ")]
    assert " ".join(ln.removeprefix("voxpipe: ") for ln in said) == "Let me see. It is 42.", text  # no markup
    you = next(k for k, ln in enumerate(lines) if ln.startswith("you: alpha bravo charlie"))
    assert you < i < lines.index(said[-1]), text
    assert lines[-1] == "[listening]"


async def test_a_turn_without_words_says_didnt_catch_that(room):
    async def script(r: Room, out: io.StringIO) -> None:
        r.say(np.concatenate([noise(800), silence(10)]))
        await _until(lambda: "didn't catch that" in out.getvalue(), "turn.empty", out)

    text = await _talk(fake_engines(), room, script)
    assert "voxpipe mic: (didn't catch that)" in text.splitlines() and "you: " not in text


async def test_playback_stops_when_the_user_resumes_after_a_reply_was_all_sent(room):
    """A pause mid-sentence: the short reply to the first half arrives whole (no
    ``response.cancelled`` can come for it), the user goes on while it plays: the client
    stops it at once."""
    engines = fake_engines(llm=FakeLlm(default=LlmReply.of("Okay, I am listening to you.")),
                           tts=FakeTts(s_per_char=0.1, hz=TONE_HZ))  # ~2.8 s of audio, all sent within the first second

    async def script(r: Room, out: io.StringIO) -> None:
        r.say(np.concatenate([tone(1000), silence(10)]))
        await _until(lambda: "[speaking]" in out.getvalue(), "the reply playing", out)
        r.say(tone(1000))  # the same turn goes on (within the merge window)
        await _until(lambda: "(interrupted: you went on)" in out.getvalue(), "the flush", out)
        await asyncio.sleep(1.0)

    text = await _talk(engines, room, script)
    assert room.played_seconds(OUT_RATE) < 2.0, text  # not the reply's 2.8 s


async def test_the_chosen_end_of_turn_goes_to_the_server_which_says_when_it_cannot(room):
    async def script(r: Room, out: io.StringIO) -> None:
        await _ask(r, out)

    # a server without the end-of-turn model: the client says so, and the turn still ends (silence)
    text = await _talk(fake_engines(), room, script, turn={"end_of_turn": "smart-turn", "eagerness": "low"})
    assert "voxpipe mic: the server ends turns by silence" in text, text
    eot = FakeEot(default=0.95)
    text = await _talk(fake_engines(eot=eot), room, script, turn={"end_of_turn": "smart-turn"})
    assert "the server ends turns by" not in text and eot.calls, text


def test_latency_line_fits_the_turn():
    assert latency_line({"voice_to_voice": 950.4, "asr": 120, "llm_ttft": 300, "first_audio": 210}) == (
        "latency: voice-to-voice 950 ms (asr 120 ms, first token 300 ms, first audio 210 ms)")
    assert latency_line({"voice_to_voice": None, "llm_ttft": 80, "first_audio": 200}) == (
        "latency: first token 80 ms, first audio 200 ms")  # a typed turn
    assert latency_line({}) is None


def test_reply_text_follows_the_audio_position():
    view = ReplyView(1, 1, text="Hello there, how are you today?")
    assert view.reveal(0, 22050) == 0
    assert view.text[: view.reveal(22050, 22050)] == "Hello there,"  # 15 chars/s, whole words
    view.done, view.received = True, 2 * 22050
    assert view.reveal(int(0.6 * 44100), 22050) == len("Hello there, how")  # 60 % of the audio: of the text
    assert view.reveal(2 * 22050, 22050) == len(view.text)


# ---- echo ------------------------------------------------------------------------------------


@pytest.mark.parametrize("echo", ["off", "half-duplex"])
async def test_without_headphones_the_assistant_does_not_answer_itself(echo, monkeypatch):
    """The speaker heard at 0 dB: with ``--echo off`` its reply is heard as the user and
    answered (the failure the issue saw); half-duplex hears only the human."""
    r = Room(echo_gain=1.0)
    monkeypatch.setattr(audio.devices, "_sd", lambda: FakeSoundDevice(r))
    engines = fake_engines(llm=FakeLlm(default=LlmReply.of("A reply that is long enough to hear.")),
                           tts=FakeTts(s_per_char=0.03, hz=TONE_HZ))

    async def script(room: Room, out: io.StringIO) -> None:
        await _ask(room, out)
        await asyncio.sleep(4.0)  # the reply's echo has had time to be heard and answered

    text = await _talk(engines, r, script, echo=echo)
    turns = text.count("you: ")
    assert (turns > 1) if echo == "off" else (turns == 1), text


def test_half_duplex_passes_a_louder_voice_and_gates_the_echo():
    now = [0.0]
    gate = HalfDuplexGate(0.0, 6.0, clock=lambda: now[0])
    speech = (tone(20, amp=0.2) * 32767).astype(np.int16)
    assert np.array_equal(gate.near(speech), speech)  # nothing playing: as is
    gate.far((tone(20, amp=0.2) * 32767).astype(np.int16))
    assert not gate.near(speech).any()  # as loud as the playback: its echo
    loud = (tone(20, amp=0.45) * 32767).astype(np.int16)  # +7 dB
    assert np.array_equal(gate.near(loud), loud)
    now[0] += 0.1  # within the hold after a pass: open
    assert np.array_equal(gate.near(speech), speech)
    now[0] += 1.0  # the playback's tail is over
    assert np.array_equal(gate.near(speech), speech)
    assert np.array_equal(NoEchoControl().near(speech), speech)


def test_webrtc_echo_canceller_removes_a_speech_echo(audio_dir):
    """Real speech played at 22.05 kHz, its echo (40 ms later, a decaying tail, 0 dB) recorded
    at 16 kHz: the gate guards the canceller while it learns, WebRTC AEC3 takes out more than
    20 dB once converged, and a near-end voice talking over it is kept."""
    import soxr

    from audio.wav import read_audio

    def clip(name: str, rate: int) -> np.ndarray:
        x, r = read_audio(str(audio_dir / name))
        return soxr.resample(x if x.ndim == 1 else x.mean(1), r, rate).astype(np.float32)

    far22 = clip("en_ljspeech_LJ001-0007.wav", 22050)[: 22050 * 8]
    far16 = soxr.resample(far22, 22050, 16000)
    rir = np.zeros(640 + 1600, np.float32)
    rir[640] = 1.0
    tail = np.random.default_rng(0).standard_normal(1600).astype(np.float32)
    rir[640:] += tail * np.exp(-np.arange(1600) / 300) * 0.3
    echo = np.convolve(far16, rir)[: len(far16)]
    echo *= np.sqrt(np.mean(far16**2) / np.mean(echo**2))
    near = clip("en_librispeech_1995-1837-0001.wav", 16000)[: 16000 * 2]
    mic = echo.copy()
    mic[16000 * 5 : 16000 * 7] += near
    now = [0.0]  # the audio's clock (the voice is past the reply's start: clients.echo.START_S)
    aec = GuardedCanceller(WebRtcEchoCanceller(22050, delay_ms=40), HalfDuplexGate(0.04, clock=lambda: now[0]))
    out = np.zeros(len(mic), np.float32)
    converged_at = None
    for i in range(0, min(len(mic) // 320, len(far22) // 441)):  # 20 ms blocks, in step
        now[0] = i * 0.02
        aec.far((far22[i * 441 : (i + 1) * 441] * 32767).astype(np.int16))
        got = aec.near((mic[i * 320 : (i + 1) * 320] * 32767).astype(np.int16))
        out[i * 320 : (i + 1) * 320] = got / 32768
        if converged_at is None and aec.converged:
            converged_at = i * 0.02
    assert not out[: 16000 // 4].any()  # learning: the gate sends silence
    assert converged_at is not None and converged_at < 3.0, converged_at

    def db(a, b):
        return 10 * np.log10(np.mean(a**2) / max(np.mean(b**2), 1e-12))

    assert db(mic[16000 * 2 : 16000 * 5], out[16000 * 2 : 16000 * 5]) > 20  # echo alone
    assert db(near, out[16000 * 5 : 16000 * 7]) < 6  # the near-end voice is kept (less than 6 dB lost)


class _Canceller:
    """A stand-in for the WebRTC canceller that takes a fixed number of dB out of every frame."""

    def __init__(self, reduction_db: float) -> None:
        self.gain = 10 ** (-reduction_db / 20)

    def far(self, block: np.ndarray) -> None:
        pass

    def near(self, frame: np.ndarray) -> np.ndarray:
        return np.round(frame * self.gain).astype(np.int16)


def _frame(dbfs: float) -> np.ndarray:
    """20 ms of a 440 Hz tone at ``dbfs`` RMS (int16)."""
    return np.round(tone(20, amp=10 ** (dbfs / 20) * np.sqrt(2)) * 32767).astype(np.int16)


def _guarded(reduction_db: float) -> GuardedCanceller:
    """A guard over a reply that has played past its start (``START_S``, which has a check of
    its own: ``tests/test_mic_echo_start.py``); its clock then stops, which keeps the reply's
    last block in the gate's window: the reply plays on."""
    from clients.echo import START_S

    now = [0.0]
    guard = GuardedCanceller(_Canceller(reduction_db), HalfDuplexGate(0.0, clock=lambda: now[0]))  # type: ignore[arg-type]
    for i in range(round((START_S + 0.5) / 0.02)):
        now[0] = i * 0.02
        guard.far(_frame(-12.0))
    return guard


def test_a_faint_echo_left_under_the_servers_silence_level_is_handled():
    """The speaker heard at -35 dB: echo frames at -60 dBFS, the canceller's output under
    -70 dBFS (only 12 dB out, under the 15 dB test): converged, so a voice 10 dB over the leak
    passes instead of meeting the gate's 0 dB assumption."""
    guard = _guarded(12.0)
    for _ in range(30):
        assert guard.near(_frame(-60.0)).any() == guard.converged  # gated until converged
    assert guard.converged
    assert guard.coupling_db() == pytest.approx(-48.0, abs=0.1)  # -60 dBFS of echo for -12 of playback
    voice = _frame(-45.0)
    assert np.array_equal(guard.near(voice), voice)  # as the microphone heard it: AEC3's suppressor
    echo = _frame(-60.0)  # would take it for echo; and so for the hold after it
    for _ in range(round(HOLD_S / 0.02) - 1):
        assert np.array_equal(guard.near(echo), echo)
    assert np.array_equal(guard.near(echo), guard.aec.near(echo))  # then the canceller's again


def test_no_raw_frames_in_a_loud_room_or_for_the_echo_alone():
    loud = _guarded(30.0)  # a 0 dB room: the echo as loud as the playback, 30 dB taken out
    for _ in range(30):
        loud.near(_frame(-12.0))
    assert loud.converged and loud.coupling_db() == pytest.approx(0.0, abs=0.1)
    voice = _frame(-3.0)  # 9 dB over it: AEC3 keeps a voice over a loud echo, so its output goes
    assert np.array_equal(loud.near(voice), loud.aec.near(voice))
    faint = _guarded(12.0)
    for _ in range(300):  # the faint room's echo alone, however long: never raw
        faint.near(_frame(-60.0))
    assert faint.converged and faint.raw_frames == 0


def test_a_voice_the_canceller_took_out_is_not_taken_for_the_rooms_echo():
    """AEC3's suppressor takes a voice over the reply out at first (double talk): such frames
    count as handled, but not into the room's coupling (it would raise every bar)."""
    guard = _guarded(30.0)
    for _ in range(30):
        guard.near(_frame(-40.0))  # the echo: 28 dB under the playback
    assert guard.coupling_db() == pytest.approx(-28.0, abs=0.1)
    for _ in range(200):
        guard.near(_frame(-20.0))  # a voice 20 dB over the echo, "handled" by the stand-in
    assert guard.coupling_db() == pytest.approx(-28.0, abs=0.1)


def test_pauses_are_not_judged_and_a_cold_canceller_stays_gated():
    guard = _guarded(12.0)
    for _ in range(300):  # the reply's pauses: nothing above the silence level, nothing judged
        guard.near(_frame(-90.0))
    assert not guard.converged
    for _ in range(25):
        guard.near(_frame(-60.0))
    for _ in range(200):  # more pauses do not dilute what was measured
        guard.near(_frame(-90.0))
    assert guard.converged
    cold = _guarded(3.0)  # a loud echo (0 dB leak), barely reduced: never trusted alone
    for _ in range(200):
        assert not cold.near(_frame(-20.0)).any()
    assert not cold.converged


def test_with_headphones_the_guard_steps_aside_until_an_echo_is_heard():
    """``--echo auto`` with headphones: the playback (-12 dBFS) never reaches the microphone
    (-90 dBFS frames), so there is no echo to learn and the canceller never converges; once
    ``MIN_FRAMES`` such frames were heard, a voice 23 dB under the playback (which the gate
    would mute) goes as the microphone heard it, for 1.5 s of talking over the reply; an echo
    that keeps coming (the headphones taken off) brings the gate back."""
    from clients.echo import MIN_FRAMES

    guard = _guarded(12.0)
    silent, voice = _frame(-90.0), _frame(-35.0)
    for _ in range(MIN_FRAMES - 2):
        guard.near(silent)
    assert not guard.near(voice).any() and not guard.unheard  # too soon to tell: the gate
    for _ in range(200):
        guard.near(silent)
    assert guard.unheard and not guard.converged
    for _ in range(70):  # 1.4 s of the user over the reply
        assert np.array_equal(guard.near(voice), voice)
    for _ in range(20):  # an echo 12 dB under the playback, with the canceller learning nothing of it
        guard.near(_frame(-24.0))
    assert not guard.unheard and not guard.near(voice).any()


def test_a_leaking_room_is_never_taken_for_headphones():
    """A faint room: the reply's pauses (-90 dBFS) between its echo (-60 dBFS), one frame in
    two: under the 90 % it takes to step aside."""
    guard = _guarded(12.0)
    for i in range(400):
        guard.near(_frame(-90.0 if i % 2 else -60.0))
        assert not guard.unheard


# ---- devices ---------------------------------------------------------------------------------


def test_list_devices_prints_each_with_its_index_and_the_defaults(room, capsys):
    from cli.main import main

    assert main(["mic", "--list-devices"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "     0  HDMI output  (0 in, 2 out, ALSA)"
    assert lines[2] == "<>   2  Built-in Audio  (2 in, 2 out, ALSA)"
    assert lines[-1] == "(< default input, > default output)"


def test_devices_by_index_or_name(room):
    from audio.devices import DeviceError, resolve_device

    assert resolve_device("1", "input") == 1  # all digits: an index, not a name
    assert resolve_device("usb", "input") == 1
    assert resolve_device("built-in audio", "output") == 2  # the exact name beats "…Loopback"
    assert resolve_device(None, "input") is None
    with pytest.raises(DeviceError, match="no input device with index 0"):
        resolve_device("0", "input")  # HDMI has no input
    with pytest.raises(DeviceError, match="matches several output devices"):
        resolve_device("built", "output")
    with pytest.raises(DeviceError, match="no output device matches 'usb'"):
        resolve_device("usb", "output")


def test_run_mic_opens_the_devices_it_was_given(monkeypatch):
    sd = FakeSoundDevice(Room())
    monkeypatch.setattr(audio.devices, "_sd", lambda: sd)
    with fake_server_thread() as srv:
        out = io.StringIO()
        threading.Timer(3.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        assert run_mic(srv.ws, input_device="usb", output_device="3", console=Console(out), echo="off") == 0
    assert {(s.kind, s.device) for s in sd.opened} == {("input", 1), ("output", 3)}


# ---- start-up failures, Ctrl+C, server gone ----------------------------------------------------


NO_AUDIO = dict(os.environ, PULSE_SERVER="unix:/nonexistent/pulse")  # no sound card here, no sound server


def _one_line(r: subprocess.CompletedProcess, code: int, *words: str) -> None:
    err = r.stderr.strip()
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "\n" not in err and "Traceback" not in err and err.startswith("voxpipe mic: "), err
    assert all(w in err for w in words), err


def test_every_startup_failure_is_one_line_and_an_exit_status():
    with fake_server_thread() as srv:
        _one_line(_voxpipe("mic", "--url", srv.ws, env=NO_AUDIO), 2, "cannot open the speaker: no audio devices",
                  "PulseAudio")  # plain words, as --list-devices says it (not PortAudio's "device -1")
        _one_line(_voxpipe("mic", "--url", srv.ws.replace("/ws", "/nope")), 3, "HTTP 404", "/ws")
        _one_line(_voxpipe("mic", "--url", srv.ws, "--input-device", "no-such-mic", env=NO_AUDIO), 2, "no-such-mic")
    _one_line(_voxpipe("mic", "--url", f"ws://127.0.0.1:{free_port()}/ws"), 3, "no voxpipe server")
    _one_line(_voxpipe("mic", "--list-devices", env=NO_AUDIO), 2, "no audio devices")
    _one_line(_voxpipe("mic", "--url", "http://x"), 2, "bad --url")


def test_a_speaker_that_fails_to_open_is_one_line(monkeypatch):
    monkeypatch.setattr(audio.devices, "_sd", lambda: FakeSoundDevice(fail_open="Device unavailable"))
    out = io.StringIO()
    with fake_server_thread() as srv:
        assert run_mic(srv.ws, console=Console(out)) == 2
    assert out.getvalue() == "voxpipe mic: cannot open the speaker: Error opening output stream: Device " \
                             "unavailable [PaErrorCode -9996]\n"


@pytest.mark.parametrize(("devices", "says"), [
    ([], "cannot open the speaker: no audio devices (is a sound server such as PulseAudio or PipeWire running?)"),
    ([{"name": "USB mic", "max_input_channels": 1, "max_output_channels": 0, "hostapi": 0}],
     "cannot open the speaker: no audio output device (voxpipe mic --list-devices shows the devices)"),
])
def test_no_speaker_at_all_is_said_in_plain_words(monkeypatch, devices, says):
    sd = FakeSoundDevice(devices=devices, fail_open="Error querying device -1")
    monkeypatch.setattr(audio.devices, "_sd", lambda: sd)
    out = io.StringIO()
    with fake_server_thread() as srv:
        assert run_mic(srv.ws, console=Console(out)) == 2
    assert out.getvalue() == f"voxpipe mic: {says}\n"


def test_ctrl_c_ends_the_session_normally(room, caplog):
    caplog.set_level(logging.INFO, logger="server.app")
    out = io.StringIO()
    with fake_server_thread() as srv:
        def interrupt() -> None:
            deadline = time.time() + DEADLINE_S
            while "listening —" not in out.getvalue() and time.time() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        assert run_mic(srv.ws, console=Console(out), echo="off") == 0
        for _ in range(int(DEADLINE_S / 0.05)):
            if any("closed (session_end)" in r.getMessage() for r in caplog.records):
                break
            time.sleep(0.05)
    closes = [r.getMessage() for r in caplog.records if " closed (" in r.getMessage()]
    assert len(closes) == 1 and closes[0].endswith("closed (session_end)"), closes


def test_a_server_that_goes_away_is_reported(room):
    out = io.StringIO()
    ctx = fake_server_thread(VoxpipeConfig())
    srv = ctx.__enter__()

    def stop_server() -> None:
        deadline = time.time() + DEADLINE_S
        while "listening —" not in out.getvalue() and time.time() < deadline:
            time.sleep(0.05)
        ctx.__exit__(None, None, None)

    threading.Thread(target=stop_server, daemon=True).start()
    assert run_mic(srv.ws, console=Console(out), echo="off") == EXIT_GONE
    last = out.getvalue().strip().splitlines()[-1]
    assert last.startswith(("voxpipe mic: the server", "voxpipe mic: the connection to the server was lost")), last
    assert last.endswith("; the session is over"), last


def test_echo_modes_without_the_aec_package(monkeypatch):
    """``auto`` falls back to half-duplex without livekit; ``aec`` says how to install it."""
    from clients.echo import EchoUnavailable, make_echo_control

    monkeypatch.setitem(sys.modules, "livekit", None)  # import livekit.rtc fails
    monkeypatch.setitem(sys.modules, "livekit.rtc", None)
    assert isinstance(make_echo_control("auto", out_rate=22050), HalfDuplexGate)
    assert isinstance(make_echo_control("off", out_rate=22050), NoEchoControl)
    with pytest.raises(EchoUnavailable, match=r'pip install "voxpipe\[mic\]"'):
        make_echo_control("aec", out_rate=22050)
