"""``voxpipe mic`` without headphones: a real PulseAudio daemon whose speaker is heard by the
microphone at 0, -20 or -35 dB (bench/pulse_room.py), the real server and models, real speech.

One conversation per case, each with its own question clip and start offset: the question is
answered once, its reply is not cut by its own echo, the user's transcript holds no word the
reply leaked into it (bench/echo.py's :func:`~bench.echo.leaked`), and in the
:data:`QUIET_S` after the reply the assistant never answers itself (no second ``you:``
turn); then, during a second reply, a human voice 10 dB louder than the reply cuts it
(barge-in still works through the echo handling); Ctrl+C ends the session normally
(``session.end``: the server logs ``closed (session_end)``). ``voxpipe bench echo`` runs the
same conversation 10 times per level (docs/BENCHMARKS.md)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.echo import BARGE_TRIES, barge_in, leaked, reply_text, settle, you_lines
from bench.pulse_room import play_as_human, pulse_room, scaled_copy
from tests.conftest import ROOT

INTERRUPTION = "en_jfk_inaugural_1961.wav"
QUIET_S = 12.0
"""How long after the reply the test listens for the assistant answering itself."""
HUMAN_DBFS = -9.0
"""The barge-in voice's RMS level: about 10 dB over Piper's replies (joe: -19.5 dBFS RMS over
its voiced 20 ms blocks, -11 dBFS at its loudest block), so louder than their echo at the
microphone at every leak level here."""
HEADPHONES_VOICE_DBFS = -26.0
"""With headphones: a voice at an everyday level, 15 dB under the reply's playback level
(which the half-duplex gate, assuming an echo as loud as that, would mute)."""
CASES = [  # (echo mode, leak dB, question clip, seconds before the question)
    ("auto", 0.0, "en_librispeech_1988-24833-0003.wav", 0.0),  # "When are you getting rid of these cats? ..."
    ("auto", -20.0, "en_librispeech_3752-4944-0000.wav", 0.7),  # "Captain Frere says that the scenery ..."
    ("auto", -35.0, "en_librivox_sense_and_sensibility_01_0880.wav", 1.3),  # "He was not an ill-disposed ..."
    ("auto", None, "en_librispeech_3752-4944-0002.wav", 0.4),  # headphones: nothing leaks
]
"""One case per leak level with ``--echo auto`` (the default). ``--echo half-duplex`` alone is
tests/test_mic_cli.py's (a fake room at 0 dB), and ``voxpipe bench echo`` runs 10 real ones
per level."""


def _wait_for(log: Path, pred, timeout_s: float, what: str) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = log.read_text(errors="replace")
        if pred(text):
            return text
        time.sleep(0.25)
    pytest.fail(f"{what} not seen within {timeout_s:.0f} s; the client said:\n{log.read_text()[-3000:]}")


def _rms_dbfs(path: Path) -> float:
    import soundfile as sf

    data, _ = sf.read(str(path), dtype="float32")
    return float(20 * np.log10(np.sqrt(np.mean(np.square(data))) + 1e-9))


@pytest.mark.slow
@pytest.mark.parametrize(("echo", "leak_db", "question", "offset_s"), CASES,
                         ids=[f"{e}-{'headphones' if db is None else f'{abs(db):g}dB'}" for e, db, _, _ in CASES])
def test_mic_does_not_answer_itself_and_barge_in_still_cuts(echo, leak_db, question, offset_s, server, audio_dir,
                                                            manifest, tmp_path):
    question_wav = audio_dir / question
    level = HEADPHONES_VOICE_DBFS if leak_db is None else HUMAN_DBFS
    human = scaled_copy(audio_dir / INTERRUPTION, tmp_path / "louder.wav", level - _rms_dbfs(audio_dir / INTERRUPTION))
    out = tmp_path / "mic.txt"
    with pulse_room(tmp_path / "pulse", leak_db) as env, open(out, "w") as fh:
        client = subprocess.Popen([sys.executable, "-m", "cli", "mic", "--url", server["url"], "--echo", echo],
                                  cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for(out, lambda t: "[listening]" in t, 120, "the client listening")
            time.sleep(offset_s)
            play_as_human(env, question_wav)
            # the reply, heard in full: its latency line ends it
            text = _wait_for(out, lambda t: "latency:" in t or "(interrupted" in t, 300, "the reply")
            # the whole reply played: the assistant's own voice did not cut it
            assert "(interrupted" not in text, text
            time.sleep(QUIET_S)
            text = out.read_text()
            heard = you_lines(text)
            assert len(heard) == 1, f"the assistant answered itself {len(heard) - 1} times:\n{text}"
            assert text.count("latency:") == 1, text
            assert leaked(heard[0], manifest[question]["reference_transcript"], reply_text(text)) == 0, text

            # a second question; 2.5 s into its reply (past the 2 s merge window: a new turn, not
            # the question going on) the louder voice talks over it, and the reply stops: the
            # server's barge-in or turn merge, or the client's own cut. A reply too short to talk
            # over asks another question (bench/echo.py's barge_in).
            outcomes = []
            for again in [question_wav] + [audio_dir / q for _, _, q, _ in CASES if q != question][:BARGE_TRIES - 1]:
                if outcomes:
                    assert settle(out), out.read_text()
                outcomes.append(barge_in(out, env, again, human))
                if outcomes[-1] != "short":
                    break
            assert outcomes[-1] == "cut", f"{outcomes}:\n{out.read_text()}"
        finally:
            if client.poll() is None:
                client.send_signal(signal.SIGINT)
            try:
                rc = client.wait(30)
            except subprocess.TimeoutExpired:
                client.kill()
                rc = client.wait()
    text = out.read_text()
    assert rc == 0, text
    assert "Traceback" not in text
    _wait_for(server["log"], lambda t: "closed (session_end)" in t, 30, "the server's normal close")
