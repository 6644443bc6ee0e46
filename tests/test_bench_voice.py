"""``voxpipe bench voice`` multi-turn mode (``--turns`` / ``--duration`` / ``--compare-cache``):
its tables, the first/last-minute split and the ``/metrics`` readings on synthetic rows
(fast), and one tiny real run (slow): two turns on one connection, one row each."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

import bench.voice as voice
from bench.common import TurnRow, turn_row
from bench.voice import (
    NO_CACHE_FLAG,
    ModeRun,
    format_per_turn,
    format_summary,
    hit_rate,
    metric_sum,
    per_turn,
    soak_summary,
    turn_buckets,
    windows,
)
from cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent


def _answered(session: int, turn: int, t_s: float, ttft: float, v2v: float) -> TurnRow:
    return TurnRow(session, turn, t_s, "answered", "clip.wav", llm_ttft=ttft, voice_to_voice=v2v)


def _run(mode: str, ttft_per_turn: float, turns: int = 3, sessions: int = 3) -> ModeRun:
    """Sessions whose TTFT grows by ``ttft_per_turn`` ms a turn (session k adds k ms), 10 s a turn."""
    rows = [_answered(s, t, 10.0 * (t - 1), 100 + ttft_per_turn * t + s, 1000 + ttft_per_turn * t + s)
            for s in range(sessions) for t in range(1, turns + 1)]
    return ModeRun(mode, rows, span_s=10.0 * turns, hit_rate=0.8, peak_rss_mib=1234.5)


def _table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| turn") and not line.startswith("| mode")]


def test_turn_indices_are_rows_up_to_20_then_equal_buckets():
    assert turn_buckets(2) == [(1, 1), (2, 2)]
    assert turn_buckets(20) == [(i, i) for i in range(1, 21)]
    assert turn_buckets(45) == [(lo, lo + 2) for lo in range(1, 46, 3)]  # 15 buckets of 3
    assert turn_buckets(41)[-1] == (40, 41) and len(turn_buckets(41)) == 14  # buckets of 3, the last short
    assert turn_buckets(0) == []


def test_per_turn_table_has_the_median_over_sessions_for_each_mode_side_by_side():
    runs = [_run("cache", 10.0), _run("no cache", 100.0)]
    runs[1].rows[0] = TurnRow(0, 1, 0.0, "busy", "clip.wav", busy="queue")  # refused: counted, not measured
    table = per_turn(runs)
    assert [r["turns"] for r in table] == ["1", "2", "3"]
    assert table[1]["cache"] == {"llm_ttft_p50": 121.0, "voice_to_voice_p50": 1021.0, "answered": 3, "total": 3}
    assert table[0]["no cache"]["llm_ttft_p50"] == 201.5 and table[0]["no cache"]["answered"] == 2
    text = format_per_turn(table, ["cache", "no cache"])
    assert text.splitlines()[0] == ("| turn | cache TTFT p50 | cache v2v p50 | cache answered | no cache TTFT p50 | "
                                    "no cache v2v p50 | no cache answered |")
    rows = _table_rows(text)
    assert rows[0] == ["1", "111", "1011", "3/3", "202", "1102", "2/3"]
    assert [r[0] for r in rows] == ["1", "2", "3"]


def test_a_turn_index_with_nothing_answered_prints_a_dash():
    run = ModeRun("cache", [TurnRow(0, 1, 0.0, "busy", busy="queue")], span_s=5.0)
    assert _table_rows(format_per_turn(per_turn([run]), ["cache"])) == [["1", "–", "–", "0/1"]]


def test_long_runs_group_turn_indices_in_buckets():
    run = _run("cache", 1.0, turns=40, sessions=1)
    table = per_turn([run])
    assert [r["turns"] for r in table][:2] == ["1-2", "3-4"] and len(table) == 20
    assert table[0]["cache"]["llm_ttft_p50"] == 101.5 and table[0]["cache"]["total"] == 2


def test_first_and_last_minute_of_a_soak():
    # 300 s, a turn every 5 s per session, TTFT = 100 ms + 1 ms per second of the run
    rows = [_answered(s, k + 1, 5.0 * k, 100 + 5.0 * k, 1000 + 2 * 5.0 * k) for s in range(4) for k in range(60)]
    first, last, w = windows(rows, 300.0)
    assert w == 60.0
    assert {r.t_s for r in first} == {5.0 * k for k in range(12)}  # 0..55 s
    assert {r.t_s for r in last} == {5.0 * k for k in range(48, 60)}  # 240..295 s
    s = soak_summary(ModeRun("cache", rows, 300.0, hit_rate=0.5, peak_rss_mib=900.0))
    assert s["ttft_first_p50"] == 127.5 and s["ttft_last_p50"] == 367.5
    assert s["ttft_last_over_first"] == pytest.approx(367.5 / 127.5)
    assert s["v2v_first_p50"] == 1055.0 and s["v2v_last_p50"] == 1535.0
    assert (s["turns"], s["answered"], s["busy"], s["window_s"]) == (240, 240, 0, 60.0)


def test_a_run_shorter_than_two_minutes_compares_its_halves():
    rows = [_answered(0, 1, 0.0, 100, 1000), _answered(0, 2, 12.0, 300, 1500)]
    first, last, w = windows(rows, 20.0)
    assert w == 10.0 and first == rows[:1] and last == rows[1:]
    s = soak_summary(ModeRun("no cache", rows, 20.0))
    assert s["ttft_last_over_first"] == 3.0 and s["v2v_last_over_first"] == 1.5
    line = _table_rows(format_summary([s]))[0]
    assert line == ["no cache", "10", "2", "2", "0", "100 / 300", "3.00", "1000 / 1500", "1.50", "n/a", "n/a"]


def test_summary_row_quotes_hit_rate_and_peak_rss_and_dashes_what_was_not_measured():
    s = soak_summary(ModeRun("cache", [TurnRow(0, 1, 0.0, "busy", busy="queue")], 30.0, hit_rate=0.8125,
                             peak_rss_mib=1234.5))
    assert math.isnan(s["ttft_first_p50"]) and math.isnan(s["ttft_last_over_first"])
    assert _table_rows(format_summary([s]))[0] == ["cache", "15", "1", "0", "1", "– / –", "–", "– / –", "–",
                                                   "81.2 %", "1234"]


METRICS_BEFORE = """# HELP voxpipe_llm_prefix_cache_hit_tokens_total prompt tokens found in the prefix cache
# TYPE voxpipe_llm_prefix_cache_hit_tokens_total counter
voxpipe_llm_prefix_cache_hit_tokens_total 100.0
voxpipe_llm_prefix_cache_hit_tokens_created 1.7e9
voxpipe_llm_prefix_cache_queried_tokens_total 400.0
voxpipe_process_rss_bytes 1.048576e9
"""
METRICS_AFTER = """voxpipe_llm_prefix_cache_hit_tokens_total{model="main"} 700.0
voxpipe_llm_prefix_cache_hit_tokens_total{model="fallback"} 0.0
voxpipe_llm_prefix_cache_queried_tokens_total{model="main"} 1200.0
voxpipe_llm_prefix_cache_queried_tokens_total{model="fallback"} 0.0
"""


def test_metrics_are_read_from_the_prometheus_page():
    assert metric_sum(METRICS_BEFORE, "voxpipe_process_rss_bytes") == 1.048576e9
    assert metric_sum(METRICS_BEFORE, "voxpipe_llm_prefix_cache_hit_tokens_total") == 100.0  # not _created
    assert metric_sum(METRICS_AFTER, "voxpipe_llm_prefix_cache_queried_tokens_total") == 1200.0  # labels summed
    assert metric_sum(METRICS_AFTER, "voxpipe_process_rss_bytes") is None and metric_sum(None, "x") is None


def test_hit_rate_is_the_ratio_of_the_counters_increase_else_none():
    assert hit_rate(METRICS_BEFORE, METRICS_AFTER) == 600 / 800
    assert hit_rate("voxpipe_process_rss_bytes 1\n", METRICS_AFTER) is None  # counters absent: n/a
    assert hit_rate(METRICS_BEFORE, METRICS_BEFORE) is None  # nothing queried during the run


def test_compare_cache_runs_the_default_then_no_prefix_cache_appended_to_serve_args():
    args = Namespace(serve_args="--tts-threads 2", compare_cache=True)
    assert voice._modes(args) == [("cache", ["--tts-threads", "2"]),
                                  ("no cache", ["--tts-threads", "2", NO_CACHE_FLAG])]
    assert voice._modes(Namespace(serve_args="", compare_cache=False)) == [("cache", [])]
    assert voice._modes(Namespace(serve_args=NO_CACHE_FLAG, compare_cache=False))[0][0] == "no cache"
    assert voice._mode_log("x/s.log", "no cache", True) == str(Path("x/s.no-cache.log"))
    assert voice._mode_log("x/s.log", "cache", True) == "x/s.log"


def test_cli_flags():
    p = build_parser()
    a = p.parse_args(["bench", "voice", "--turns", "20", "--compare-cache"])
    assert (a.turns, a.duration, a.compare_cache, a.sessions) == (20, None, True, None)
    assert p.parse_args(["bench", "voice", "--duration", "300", "--sessions", "4"]).duration == 300.0
    with pytest.raises(SystemExit):
        p.parse_args(["bench", "voice", "--turns", "2", "--duration", "60"])


def test_turn_outcomes():
    from clients.turn import AskResult

    done = AskResult(events=[{"type": "response.done", "timings_ms": {"llm_ttft": 150.0, "voice_to_voice": 900.0},
                              "output_tokens": 12, "audio_s": 2.5}], timings_ms={"voice_to_voice": 880.0})
    row = turn_row(done, 1, 3, 12.5, "a.wav")
    assert (row.outcome, row.llm_ttft, row.voice_to_voice, row.server_voice_to_voice) == ("answered", 150.0, 880.0,
                                                                                          900.0)
    assert turn_row(AskResult(busy={"reason": "queue"}), 0, 1, 0, "a").busy == "queue"
    assert turn_row(AskResult(empty_reason="no_words"), 0, 1, 0, "a").outcome == "empty"
    assert turn_row(AskResult(), 0, 1, 0, "a").outcome == "error"


def _args(**kw) -> Namespace:
    base = dict(llm="smollm2", sessions=[2], turns=3, duration=None, compare_cache=True, lockstep=False,
                serve_args="", server_log=None, json=False)
    return Namespace(**{**base, **kw})


def test_main_prints_both_tables_or_one_json_object(monkeypatch, capsys):
    calls: list[tuple[str, list[str], int]] = []

    def fake_run(args, mode, orders, extra):
        calls.append((mode, extra, len(orders)))
        return _run(mode, 10.0 if mode == "cache" else 100.0, sessions=len(orders))

    monkeypatch.setattr(voice, "run_mode", fake_run)
    monkeypatch.setattr(voice, "_serve_knows", lambda option: True)
    clips = [Path("a.wav"), Path("b.wav")]
    assert voice.multi_turn_main(_args(), clips) == 0
    assert calls == [("cache", [], 2), ("no cache", [NO_CACHE_FLAG], 2)]
    out = capsys.readouterr().out
    assert "| turn | cache TTFT p50 |" in out and "| 3 | " in out
    assert [r[0] for r in _table_rows(out) if r[0] in ("cache", "no cache")] == ["cache", "no cache"]
    assert "80.0 %" in out and "1234" in out

    assert voice.multi_turn_main(_args(json=True), clips) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["mode"] for s in doc["summary"]] == ["cache", "no cache"]
    assert doc["per_turn"][0]["turns"] == "1" and len(doc["rows"]["no cache"]) == 6


def test_main_refuses_what_it_cannot_run(monkeypatch, capsys):
    monkeypatch.setattr(voice, "run_mode", lambda *a: pytest.fail("must not start a server"))
    monkeypatch.setattr(voice, "_serve_knows", lambda option: False)
    assert voice.multi_turn_main(_args(), [Path("a.wav")]) == 2
    assert NO_CACHE_FLAG in capsys.readouterr().err
    assert voice.multi_turn_main(_args(sessions=[1, 4], compare_cache=False), [Path("a.wav")]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_multi_turn_run_prints_one_row_per_turn():
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "voice", "--sessions", "1", "--turns", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=550)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _table_rows(out.stdout)
    per_turn_rows = {r[0]: r for r in rows if len(r) == 4}
    assert set(per_turn_rows) == {"1", "2"}, out.stdout
    assert all(r[3] == "1/1" and r[1] != "–" and r[2] != "–" for r in per_turn_rows.values()), out.stdout
    summary = [r for r in rows if r[0] == "cache"]
    assert len(summary) == 1 and summary[0][2:4] == ["2", "2"], out.stdout


# ---- the single-turn table's transports (``--transport``) -----------------------------------------


def test_first_loud_s_is_where_the_first_loud_20_ms_of_a_reply_starts():
    from bench.voice_table import first_loud_s

    rate = 24000
    quiet, loud = np.full(480, 0.001, np.float32), np.full(480, 0.1, np.float32)
    # chunks split mid-window: windows are counted over the whole reply
    assert first_loud_s([np.concatenate([quiet, quiet[:100]]), np.concatenate([quiet[100:], loud, loud])], rate) \
        == pytest.approx(0.04)
    assert first_loud_s([loud], rate) == 0.0
    assert first_loud_s([quiet, quiet], rate) == 0.0  # nothing loud: the first frame's arrival stands
    assert first_loud_s([], rate) == 0.0


def test_one_session_alternates_the_transports_clip_by_clip_and_rows_quote_the_transport_time(monkeypatch):
    import asyncio

    import bench.voice_table as vt

    calls: list[tuple[str, str]] = []

    async def session(url, clips, out, codec="pcm", open_mic=False):
        await asyncio.sleep(0)
        assert open_mic  # WebRTC is compared: every transport's turns end by the server's detection
        for clip in clips:
            calls.append((codec, clip.name))
            server = {"pcm": 1000.0, "opus": 1100.0, "webrtc": 900.0}[codec]
            out.append({"clip": clip.name, "voice_to_voice": server, "client_voice_to_voice": server + 20,
                        "transport_ms": 20.0})

    monkeypatch.setattr(vt, "start_server", lambda *a, **k: None)
    monkeypatch.setattr(vt, "stop_server", lambda proc: None)
    monkeypatch.setattr(vt, "free_port", lambda: 1)
    monkeypatch.setattr(vt, "_session", session)
    args = Namespace(llm="x", sessions=[1], repeat=1, lockstep=False, slo_ms=2000.0,
                     transport=["pcm", "opus", "webrtc"])
    table = vt.single_turn_table(args, [Path("a.wav"), Path("b.wav"), Path("c.wav")], [])
    assert calls == [("pcm", "a.wav"), ("opus", "a.wav"), ("webrtc", "a.wav"),
                     ("opus", "b.wav"), ("webrtc", "b.wav"), ("pcm", "b.wav"),
                     ("webrtc", "c.wav"), ("pcm", "c.wav"), ("opus", "c.wav")]
    assert [(r["transport"], r["responses"]) for r in table] == [("pcm", 3), ("opus", 3), ("webrtc", 3)]
    assert all(r["transport_ms"] == (20.0, 20.0) for r in table)
    assert table[1]["client_voice_to_voice"] == (1120.0, 1120.0)


def test_turns_end_by_the_server_when_webrtc_is_compared_unless_told():
    from bench.voice_table import turn_end

    assert turn_end(Namespace(transport=["pcm", "opus"])) == "client"
    assert turn_end(Namespace(transport=["pcm", "webrtc"])) == "server"
    assert turn_end(Namespace(transport=["pcm", "webrtc"], turn_end="client")) == "client"
    assert turn_end(Namespace(transport=["pcm"], turn_end="server")) == "server"
    assert turn_end(Namespace()) == "client"


@pytest.mark.parametrize("codec", ["pcm", "opus"])
async def test_ask_with_an_open_mic_sends_silence_and_the_server_ends_the_turn(tmp_path, codec):
    """``open_mic``: after the file, silence at the same pace and no ``input.end``: the
    server's end-of-turn detection ends the turn (as over WebRTC); the bytes per second
    count the silence sent."""
    import soundfile as sf

    from clients.client import ask
    from tests.fake_server import fake_server

    rate = 16000
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(rate) / rate)
    path = tmp_path / "q.wav"
    sf.write(path, np.concatenate([np.zeros(rate // 4), tone, np.zeros(rate // 10)]).astype(np.float32), rate,
             subtype="PCM_16")
    async with fake_server() as srv:
        res = await ask(str(path), url=srv.ws, open_mic=True, codec=codec, timeout_s=60)
    stopped = [e for e in res.events if e["type"] == "speech.stopped"]
    assert stopped and all(e["reason"] != "input_end" for e in stopped), stopped
    assert [e for e in res.events if e["type"] == "response.done"] and not res.errors
    assert res.audio_sent_s > 1.35  # the file (1.35 s) and silence after it, until the reply was done
    assert res.timings_ms.get("voice_to_voice") is not None


def test_idle_cpu_opens_one_silent_session_per_transport_and_reads_both_processes(capsys):
    """``--idle-cpu-s``: each transport's session opens, streams silence and is measured in
    turn (a fake server in this process: server and client are the same process here), and
    the table prints a row each."""
    import os

    from bench.transport_cpu import idle_cpu, idle_cpu_lines
    from tests.fake_server import fake_server_thread

    with fake_server_thread() as srv:
        rows = idle_cpu(srv.ws, os.getpid(), ["pcm", "opus", "webrtc"], seconds=1.0, lead_s=0.2)
    assert [r.transport for r in rows] == ["pcm", "opus", "webrtc"]
    # CPU time comes in 10 ms ticks (and the two reads of this one process are a tick apart at
    # most): one light second may read 0, three streaming ones do not
    assert all(r.server_ms_per_s >= 0 and abs(r.server_ms_per_s - r.client_ms_per_s) <= 25 for r in rows), rows
    assert sum(r.server_ms_per_s for r in rows) > 0, rows
    lines = idle_cpu_lines(rows, 1.0)
    assert len(lines) == 6 and lines[-1].startswith("| webrtc | ")
