"""``voxpipe bench edge``: its aggregation and table (fast), its abuser's audio (fast), and
one tiny real run (slow): a fresh server per scenario, the abuser in its own process."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.edge import ScenarioResult, format_table, summarize, within_limit
from bench.edge_abuser import BIG_FRAME_BYTES, AbuserStats, abuser_stream, big_frame, stream_frames
from bench.voice import TurnRow

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "tests" / "data" / "audio"


def _answered(v2v: list[float]) -> list[TurnRow]:
    return [TurnRow(0, k + 1, float(k), "answered", "a.wav", voice_to_voice=x, server_voice_to_voice=x - 50)
            for k, x in enumerate(v2v)]


def test_rows_give_p50_p95_and_the_ratio_to_alone():
    alone = ScenarioResult("alone", _answered([900.0, 1000.0, 1100.0, 1200.0]), 4)
    flood_turns = _answered([1500.0, 2500.0]) + [
        TurnRow(0, 3, 3.0, "busy", "a.wav", busy="queue"),
        TurnRow(0, 4, 4.0, "error", "a.wav", error="timeout (last event: speech.stopped)"),
        TurnRow(0, 5, 5.0, "answered", "a.wav")]  # text only: no audio, no voice-to-voice
    abuser = AbuserStats("stream", speed=20.0, seconds=10.0, messages=10_000, audio_sent_s=200.0, audio_heard_s=150.0,
                         replies=3, errors={"rate_limited": 1}, busy={"queue": 7})
    flood = ScenarioResult("flood_20x", flood_turns, 7, abuser)
    rows = summarize([alone, flood])
    assert [r["scenario"] for r in rows] == ["alone", "flood_20x"]
    a, f = rows
    assert a["v2v_p50_ms"] == 1050.0 and a["v2v_p95_ms"] == 1200.0 and a["p50_ratio"] == 1.0
    assert a["within_limit"] is True and a["abuser"] is None and a["answered"] == 4
    assert a["server_v2v_p50_ms"] == 1000.0
    assert f["answered"] == 2 and f["turns"] == 7
    assert f["outcomes"] == {"answered": 2, "busy": 1, "timeout": 1, "no audio": 1, "not taken": 2}
    assert f["v2v_p50_ms"] == 2000.0 and math.isclose(f["p50_ratio"], 2000 / 1050) and f["within_limit"] is False
    ab = f["abuser"]
    assert ab["pace"] == 20.0 and ab["audio_heard_s"] == 150.0 and ab["errors"] == {"rate_limited": 1}
    assert ab["busy"] == {"queue": 7} and ab["replies"] == 3


def test_without_alone_or_answers_the_ratio_is_unknown():
    rows = summarize([ScenarioResult("big_frames", [TurnRow(0, 1, 0.0, "error", "a.wav", error="timeout")], 1,
                                     AbuserStats("big", failure="OSError: refused"))])
    (r,) = rows
    assert math.isnan(r["v2v_p50_ms"]) and math.isnan(r["p50_ratio"]) and r["within_limit"] is False  # a lost turn
    table = format_table(rows)
    assert "| big_frames | 0/1 (timeout 1) | – | – | – (turns lost) |" in table
    assert "failed: OSError: refused" in table


def test_within_the_limit_means_every_turn_answered_and_p50_within_10_percent():
    assert within_limit(1.10, 8, 8) is True and within_limit(1.11, 8, 8) is False
    assert within_limit(0.9, 7, 8) is False and within_limit(float("nan"), 0, 8) is False
    assert within_limit(float("nan"), 8, 8) is None  # no alone row to compare with


def test_the_table_has_one_line_per_scenario_and_flags_the_limit():
    alone = ScenarioResult("alone", _answered([1000.0] * 3), 3)
    neighbour = ScenarioResult("neighbour_1x", _answered([1050.0] * 3), 3,
                               AbuserStats("stream", speed=1.0, seconds=30.0, messages=1500, audio_sent_s=30.0,
                                           audio_heard_s=27.0, replies=4))
    flood = ScenarioResult("flood_20x", _answered([1500.0] * 3), 3,
                           AbuserStats("stream", speed=20.0, seconds=30.0, messages=30_000, audio_sent_s=600.0,
                                       audio_heard_s=580.0, errors={"rate_limited": 1},
                                       closes={"1011 keepalive ping timeout": 2}, connections=3))
    lines = format_table(summarize([alone, neighbour, flood])).splitlines()
    assert len(lines) == 2 + 3 and all(line.count("|") == 11 for line in lines)
    assert lines[2].startswith("| alone | 3/3 | 1000 | 1000 | 1.00 | – |")
    assert lines[3].startswith("| neighbour_1x | 3/3 | 1050 | 1050 | 1.05 | 30 (1.0×) | 27 | 4 | – | – |")
    assert ("| 1.50 (> 1.10) | 600 (20.0×) | 580 | 0 | rate_limited 1; closed: 1011 keepalive ping timeout ×2 "
            "(reconnected) | – |") in lines[4]


def test_the_abuser_stream_is_the_clips_with_pauses_cut_in_frames():
    clips = [AUDIO / "en_cmu_goforward.wav", AUDIO / "en_librispeech_3752-4944-0000.wav"]
    loop = abuser_stream(clips, 16000, pause_s=3.0)
    assert abs(len(loop) / 2 / 16000 - (2.786 + 3.335 + 2 * 3.0)) < 0.01
    assert loop[-2 * 16000:] == bytes(2 * 16000)  # ends in silence
    frames = stream_frames(loop, 16000)
    assert {len(f) for f in frames} == {640} and b"".join(frames)[:len(loop)] == loop
    low = abuser_stream(clips, 8000, pause_s=3.0)
    assert abs(len(low) - len(loop) / 2) <= 4
    big = big_frame(low)
    assert len(big) == BIG_FRAME_BYTES < 4 * 1024 * 1024 and big[:len(low)] == low


def test_the_command_line_takes_its_options():
    from cli.main import build_parser

    args = build_parser().parse_args(["bench", "edge", "--scenarios", "alone", "flood_20x", "--turns", "3",
                                 "--serve-args", "--slo-ms 3000", "--json"])
    assert args.scenarios == ["alone", "flood_20x"] and args.turns == 3 and args.llm == "smollm2"
    assert args.serve_args == "--slo-ms 3000" and args.json and args.server_log is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "edge", "--scenarios", "nope"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_run_prints_one_json_object_with_the_abuser_counted():
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "edge", "--turns", "1", "--warmup", "0",
                          "--lead-in-s", "1", "--turn-timeout", "20", "--scenarios", "alone", "big_frames", "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout)
    alone, big = res["scenarios"]
    assert alone["scenario"] == "alone" and alone["answered"] == 1 and alone["v2v_p50_ms"] > 0
    assert alone["p50_ratio"] == 1.0 and alone["abuser"] is None
    a = big["abuser"]
    assert big["scenario"] == "big_frames" and a["kind"] == "big" and a["failure"] is None
    assert a["messages"] >= 1 and a["audio_sent_s"] >= 262  # one frame: 4 MiB of 8 kHz PCM16
    assert sum(big["outcomes"].values()) == 1
