"""``voxpipe bench echo`` (bench/echo.py) and its room (bench/pulse_room.py): the counting,
the levels and the table on synthetic input (fast; the real runs are in docs/BENCHMARKS.md
and tests/test_mic_loopback.py)."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf

from bench.echo import (
    Run,
    block_dbfs,
    first_sound_s,
    format_table,
    heard_v2v_ms,
    leaked,
    reply_end,
    server_v2v_ms,
    speech_end_s,
)
from bench.pulse_room import PA_VOLUME_NORM, pulse_volume
from cli.main import build_parser


def test_leaked_words_are_the_replys_words_the_speaker_did_not_say():
    assert leaked("when are you getting rid of these cats that's the story", "WHEN ARE YOU GETTING RID OF THESE CATS",
                  "That's the story of my cats.") == 3
    assert leaked("when are you getting rid of these cats", "WHEN ARE YOU GETTING RID OF THESE CATS",
                  "Cats are nice.") == 0
    # a word misheard in place (the reply repeats it back) is the ASR's, not a leak
    assert leaked("Captain Freer says that the scenery is delightful.", "CAPTAIN FRERE SAYS THAT THE SCENERY IS "
                  "DELIGHTFUL", "That's a great compliment, Captain Freer.") == 0
    assert leaked("when are you getting rid that's the story these cats", "WHEN ARE YOU GETTING RID OF THESE CATS",
                  "That's the story.") == 3


def test_pulse_volume_is_cubic_in_amplitude():
    assert pulse_volume(0) == PA_VOLUME_NORM
    assert pulse_volume(-20) == round(PA_VOLUME_NORM * 0.1 ** (1 / 3))  # 30419: pactl shows -20.00 dB
    assert pulse_volume(-35) < pulse_volume(-20) < pulse_volume(0)


def test_levels_find_where_speech_ends_and_where_playback_starts(tmp_path):
    rate = 16000
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(rate) / rate).astype(np.float32)
    clip = np.concatenate([tone, np.zeros(rate // 2, np.float32)])  # 1 s of sound, 0.5 s of silence
    sf.write(tmp_path / "q.wav", clip, rate)
    assert speech_end_s(tmp_path / "q.wav") == pytest.approx(1.0, abs=0.021)
    rec = np.concatenate([np.zeros(rate, np.float32), tone[: rate // 4], np.zeros(rate, np.float32), tone])
    (tmp_path / "r.raw").write_bytes((rec * 32767).astype("<i2").tobytes())
    assert first_sound_s(tmp_path / "r.raw", 0.0) == pytest.approx(1.0, abs=0.021)
    assert first_sound_s(tmp_path / "r.raw", 1.5) == pytest.approx(2.25, abs=0.021)
    assert first_sound_s(tmp_path / "r.raw", 9.0) is None
    assert block_dbfs(np.ones(320, np.float32), rate)[0] == pytest.approx(0.0, abs=0.01)
    # the room: 0.5 s quiet, then the question (1 s of sound); the speaker: the reply 0.8 s after its end
    room = np.concatenate([np.zeros(rate // 2, np.float32), clip])
    speaker = np.concatenate([np.zeros(int(rate * 2.3), np.float32), tone])
    for name, x in (("room.raw", room), ("speaker.raw", speaker)):
        (tmp_path / name).write_bytes((x * 32767).astype("<i2").tobytes())
    v2v = heard_v2v_ms(tmp_path / "speaker.raw", tmp_path / "room.raw", tmp_path / "q.wav")
    assert v2v == pytest.approx(800, abs=41)


def test_the_table_sums_each_level_and_the_options_parse():
    runs = [Run(0.0, "auto", "a", heard=True, barge_in=True, barge_tries=2, v2v_ms=900, server_v2v_ms=700),
            Run(0.0, "auto", "b", heard=True, self_cut=1, leaked_words=2, barge_in=False, barge_tries=1,
                v2v_ms=1100),
            Run(0.0, "auto", "c", heard=True, barge_tries=3, error="the client did not settle"),
            Run(None, "auto", "a", heard=True, barge_in=True, barge_tries=1, v2v_ms=870, server_v2v_ms=690),
            Run(None, "off", "a", heard=True, barge_in=True, barge_tries=1, v2v_ms=850, server_v2v_ms=680)]
    table = format_table(runs).splitlines()
    # clip b has no headphones run: only a's +50 is paired; c found no reply to talk over
    # the client path (heard - server's v2v): a's 200 and 180 against the headphones' 170
    assert table[2] == "| 0 | auto | 3 | 3 | 1 | 0 | 2 | 1/2 (6) | 1000 (1100) | 700 (700) | +50 (1) | +30 (1) | 1 |"
    assert table[3] == "| none | auto | 1 | 1 | 0 | 0 | 0 | 1/1 (1) | 870 (870) | 690 (690) | +20 (1) | +10 (1) | 0 |"
    assert table[4] == "| none (headphones) | off | 1 | 1 | 0 | 0 | 0 | 1/1 (1) | 850 (850) | 680 (680) | - | - | 0 |"
    args = build_parser().parse_args(["bench", "echo", "--runs", "2", "--leak-db", "-20", "--controls"])
    assert (args.runs, args.leak_db, args.echo, args.controls) == (2, "-20", "auto", True)


def test_a_reply_ends_cut_or_done_and_its_latency_line_is_read():
    cut = "voxpipe: That's a nice way (interrupted: you talked over it)\n  latency: voice-to-voice 1278 ms (asr 1 ms)\n"
    assert reply_end(cut) == "cut"
    assert reply_end("voxpipe: Hello.\n  latency: voice-to-voice 900 ms\n[listening]\nvoxpipe: x (interrupted: a new "
                     "turn began)") == "done"  # the reply that was playing ended first; a later one was cut
    assert reply_end("voxpipe: still playing,\n") is None
    assert server_v2v_ms("[speaking]\n" + cut) == 1278.0
    assert server_v2v_ms("  latency: first audio 300 ms\n") is None


def test_the_rows_take_turns_run_by_run():
    from bench.echo import run_plan

    assert run_plan([0.0, -20.0], 2, "auto", 3) == [(0.0, "auto"), (-20.0, "auto"), (None, "off"),
                                                    (0.0, "auto"), (-20.0, "auto"), (None, "off"), (None, "off")]
    assert run_plan([-35.0], 1, "aec", 0) == [(-35.0, "aec")]
    assert run_plan([0.0], 1, "auto", 1, controls=True) == [(0.0, "auto"), (None, "auto"), (None, "off")]
