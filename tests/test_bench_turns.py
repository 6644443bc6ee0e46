"""``voxpipe bench turns``: the stored cuts and the scripted set (fast; the Piper backchannels
replaced by tones), the measures on hand-made wire logs (fast), a row whose server refuses
its flags (fast: the server exits before loading a model), and one small real run of the
bench on one row (slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

import bench.turn_set as turn_set
from bench.turn_cuts import RATE, load_clip, read_cuts
from bench.turn_metrics import CaseLog, case_result, summarize
from bench.turn_set import BURST_DELAY_S, CLASSES, LEAD_S, PAUSES_S, build_set
from bench.turns import format_table, run_row

ROOT = Path(__file__).resolve().parent.parent


def test_stored_cuts_lie_inside_their_clips_and_pauses_inside_their_sentences():
    rows = read_cuts()
    assert {r["kind"] for r in rows} == {"turn", "pause", "interruption"}
    for r in rows:
        dur = len(load_clip(r["clip"])) / RATE
        assert 0.0 <= r["start_s"] <= r["end_s"] <= dur, r
        assert r["before"].strip(), r
    for p in (r for r in rows if r["kind"] == "pause"):
        assert p["after"].strip()
        assert any(t["clip"] == p["clip"] and t["start_s"] < p["start_s"] <= p["end_s"] < t["end_s"]
                   for t in rows if t["kind"] == "turn"), p
    for r in rows:
        if r["kind"] != "pause":
            assert r["end_s"] - r["start_s"] >= 1.0, r  # a sentence or a phrase, not a word


@pytest.fixture
def tones(monkeypatch):
    """Backchannels as 0.4 s tones: no Piper voice in a fast test."""
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(0.4 * RATE)) / RATE)).astype(np.float32)
    monkeypatch.setattr(turn_set, "backchannels", lambda: [("Yeah.", tone), ("Okay.", tone)])


def test_the_set_has_every_class_with_its_pause_or_burst(tones):
    cases = build_set(10, seed=3)
    assert [c.cls for c in cases] == [c for c in CLASSES for _ in range(10)]
    for c in cases:
        assert c.speech.dtype == np.float32 and c.speech.ndim == 1
        assert LEAD_S < c.true_end_s < c.duration_s, c.name
        assert not np.any(c.speech[: int(LEAD_S * RATE)]), "silence before the user speaks"
        if c.cls == "pause":
            assert c.pause is not None
            a, b = c.pause
            assert round(b - a, 3) in PAUSES_S
            assert a > LEAD_S and b < c.true_end_s and c.last_start_s == pytest.approx(b)
            assert not np.any(c.speech[int(a * RATE) + 1: int(b * RATE) - 1]), "the pause is silence"
        else:
            assert c.pause is None
        if c.cls in ("backchannel", "interruption", "noise"):
            assert c.burst is not None and 0.1 < len(c.burst) / RATE < 3.0
            assert BURST_DELAY_S[0] <= c.burst_delay_s <= BURST_DELAY_S[1]
            assert 0.0 <= c.burst_onset_s < len(c.burst) / RATE
            assert np.abs(c.burst).max() <= 1.0
        else:
            assert c.burst is None
    pauses = {round(c.pause[1] - c.pause[0], 1) for c in cases if c.pause is not None}
    assert pauses == set(PAUSES_S), "several pause lengths"
    assert len({c.name for c in cases if c.cls == "pause"}) == 10, "distinct (cut, pause) pairs"
    kinds = {c.name.rsplit("+ ", 1)[1] for c in cases if c.cls == "noise"}
    assert kinds == {"cough (synthetic)", "door (synthetic)", "keyboard (synthetic)", "music (music clip)"}


def test_the_set_is_the_same_for_the_same_seed(tones):
    a, b, c = build_set(4, seed=1), build_set(4, seed=1), build_set(4, seed=2)
    assert all(np.array_equal(x.speech, y.speech) for x, y in zip(a, b, strict=True))
    assert all(x.burst_delay_s == y.burst_delay_s for x, y in zip(a, b, strict=True))
    noise_a = [x.burst for x in a if x.cls == "noise"]
    assert all(np.array_equal(x, y) for x, y in zip(noise_a, [x.burst for x in b if x.cls == "noise"], strict=True))
    assert [x.burst_delay_s for x in a] != [x.burst_delay_s for x in c]


def _ev(t: float, kind: str, **fields) -> tuple[float, dict]:
    return t, {"type": kind, **fields}


def test_a_reply_heard_in_the_pause_is_premature_and_the_last_stop_gives_the_delay():
    log = CaseLog("pause", "x", true_end=10.0, last_start_ms=4000, pause_end_ms=4000)
    log.events = [_ev(7.0, "speech.stopped", turn_id=1, audio_ms=3100, reason="silence"),
                  _ev(7.1, "response.started", response_id=1),
                  _ev(7.6, "response.cancelled", response_id=1, reason="continued"),
                  _ev(10.55, "speech.stopped", turn_id=1, audio_ms=6600, reason="silence")]
    log.audio = {1: [7.5, 7.55], 2: [11.2, 11.9]}
    r = case_result(log)
    assert r.premature and r.ended_in_pause
    assert r.eot_delay == pytest.approx(550.0) and r.voice_to_voice == pytest.approx(1200.0)
    assert r.outcome == "answered" and r.reply_id == 2


def test_a_turn_that_waits_out_the_pause_is_not_premature():
    log = CaseLog("pause", "x", true_end=10.0, last_start_ms=4000, pause_end_ms=4000)
    log.events = [_ev(10.3, "speech.stopped", turn_id=1, audio_ms=6600, reason="end_of_turn")]
    log.audio = {1: [11.0, 12.0]}
    r = case_result(log)
    assert not r.premature and not r.ended_in_pause and r.eot_delay == pytest.approx(300.0)


def test_an_interruption_that_pauses_then_cancels_counts_the_pause_as_the_stop():
    log = CaseLog("interruption", "x", true_end=10.0, burst_start=12.0, burst_pos_ms=9000, burst_word=12.1)
    log.events = [_ev(10.5, "speech.stopped", turn_id=1, audio_ms=6000, reason="silence"),
                  _ev(12.5, "speech.started", turn_id=2, audio_ms=9300),
                  _ev(12.5, "response.paused", response_id=1),
                  _ev(13.4, "response.cancelled", response_id=1, reason="barge_in"),
                  _ev(14.0, "speech.stopped", turn_id=2, audio_ms=11000, reason="silence")]
    log.audio = {1: [11.0, 12.45], 2: [15.0, 15.5]}
    r = case_result(log)
    assert r.eligible and r.lost and r.paused and not r.resumed and r.cancel_reason == "barge_in"
    assert r.stop_latency == pytest.approx(400.0)
    assert r.eot_delay == pytest.approx(500.0), "the burst's own speech.stopped is not the user's turn"


def test_a_noise_that_pauses_and_resumes_the_reply_loses_nothing():
    log = CaseLog("noise", "x", true_end=10.0, burst_start=12.0, burst_pos_ms=9000, burst_word=12.0)
    log.events = [_ev(12.3, "response.paused", response_id=1), _ev(13.0, "response.resumed", response_id=1)]
    log.audio = {1: [11.0, 14.0]}
    r = case_result(log)
    assert r.eligible and not r.lost and r.paused and r.resumed and r.stop_latency is None


def test_a_reply_sent_in_full_before_the_burst_is_not_counted():
    log = CaseLog("backchannel", "x", true_end=10.0, burst_start=12.0, burst_pos_ms=9000)
    log.events = [_ev(11.8, "response.done", response_id=1), _ev(12.9, "response.started", response_id=2)]
    log.audio = {1: [11.0, 11.8]}
    r = case_result(log)
    assert not r.eligible and not r.lost
    s = summarize([r])
    assert s["eligible"] == 0 and math.isnan(s["lost"])


def test_busy_and_errors_are_outcomes_not_answers():
    busy = CaseLog("complete", "x", true_end=10.0)
    busy.events = [_ev(10.5, "speech.stopped", turn_id=1, audio_ms=5000, reason="silence"),
                   _ev(10.5, "busy", turn_id=1, reason="queue")]
    assert case_result(busy).outcome == "busy"
    assert case_result(CaseLog("complete", "x", error="OSError")).outcome == "error"
    s = summarize([case_result(busy)])
    assert s["answered"] == 0 and s["busy"] == 1 and math.isnan(s["voice_to_voice"][0])


def test_the_table_has_a_line_per_row_and_class_and_a_failed_row_says_why():
    log = CaseLog("complete", "x", true_end=10.0)
    log.events = [_ev(10.5, "speech.stopped", turn_id=1, audio_ms=5000, reason="silence")]
    log.audio = {1: [11.0, 11.5]}
    table = [{"row": "today", "classes": {"complete": summarize([case_result(log)])}},
             {"row": "smart-turn", "failed": "server exited: no end-of-turn model"}]
    lines = format_table(table).splitlines()
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:8] == ["today", "complete", "1", "1", "0 %", "–", "500 / 500", "1000 / 1000"]
    assert "failed: server exited: no end-of-turn model" in lines[3]
    assert all(line.count("|") == lines[0].count("|") for line in lines)


def test_a_row_whose_server_refuses_its_flags_is_reported_failed_with_its_message(tmp_path, tones):
    args = Namespace(llm="smollm2", serve_args="--end-silence-ms 50", server_log_dir=str(tmp_path), concurrency=1,
                     trace=None)
    row = run_row(args, "today", build_set(1, classes=("complete",)))
    assert "end_silence_ms" in row["failed"]


@pytest.mark.slow
def test_piper_backchannels_last_as_long_as_a_backchannel():
    words = turn_set.backchannels()
    assert {w for w, _ in words} == set(turn_set.BACKCHANNELS)
    for w, audio in words:
        assert 0.25 <= len(audio) / RATE <= 0.85, (w, len(audio) / RATE)


@pytest.mark.slow
def test_bench_turns_runs_one_row_end_to_end(tmp_path):
    trace = tmp_path / "trace.jsonl"
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "turns", "--rows", "today", "--per-class", "1",
                          "--json", "--trace", str(trace), "--server-log-dir", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:] + (tmp_path / "today.log").read_text()[-3000:]
    res = json.loads(out.stdout)
    (row,) = res["rows"]
    assert row["row"] == "today" and "failed" not in row
    assert list(row["classes"]) == list(CLASSES)
    assert [c["cls"] for c in row["cases"]] == list(CLASSES)
    for cls, s in row["classes"].items():
        assert s["cases"] == 1 and s["errors"] == 0, (cls, row["cases"])
    assert row["classes"]["complete"]["answered"] == 1
    assert row["classes"]["complete"]["eot_delay"][0] > 0, "the turn ends after the speech does"
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [x["cls"] for x in lines] == list(CLASSES)
    for x in lines[2:]:  # the cases with a burst: it was sent, while the reply played
        assert x["burst_start"] is not None and x["burst_start"] > min(a[0] for a in x["audio"].values())
