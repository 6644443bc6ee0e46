"""``voxpipe bench voice --lang`` (bench/voice_lang.py): the clips per language, WER, the
summary table on hand-made turns (fast), and one tiny real run through a server (slow)."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

import bench.voice_lang as vl
from bench.voice_lang import LangRow, LangTurn, format_table, language_clips, serve_args, summary, wer
from cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
AUDIO = ROOT / "tests" / "data" / "audio"


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| language")]


def test_clips_per_language_leave_the_hard_ones_out_and_a_language_without_clips_is_an_error():
    clips = language_clips(AUDIO, ["de", "en"])
    assert [r["file"] for r in clips["de"]] == [f"de_fleurs_{i:03d}.wav" for i in (1, 0, 2, 4, 5)]
    assert len(clips["en"]) == 8 and not any("hard" in r["file"] for r in clips["en"])
    with pytest.raises(ValueError, match="no clips for \\['fr'\\]"):
        language_clips(AUDIO, ["de", "fr"])


def test_wer_normalises_case_punctuation_and_keeps_umlauts():
    ref = "er griff auch alles an was ins wasser kam"
    assert wer("de", [ref], ["Er griff auch alles an, was ins Wasser kam."]) == 0.0
    assert wer("de", ["ein großer dinosaurier"], ["ein grosser Dinosaurier"]) == pytest.approx(1 / 3)
    assert wer("en", ["IT WAS THE FIRST"], ["It was the first."]) == 0.0
    assert wer("en", ["go forward ten meters"], [""]) == 1.0


def test_the_table_has_a_row_per_language_with_wer_detection_reply_language_and_v2v():
    turns = [
        LangTurn("en", "a.wav", "go forward ten meters", "Go forward ten meters.", "en", "Okay, going.", "en",
                 900.0, "answered", heard=True),
        LangTurn("en", "b.wav", "hello there", "Hello there.", "en", "Hi!", None, 1100.0, "answered", heard=True),
        LangTurn("de", "c.wav", "wie spät ist es", "Wie spät ist es?", "de", "Es ist drei Uhr.", "de", 1500.0,
                 "answered", heard=True),
        LangTurn("de", "d.wav", "wie spät ist es", "Wie spät?", "en", "", None, None, "busy", busy="slo",
                 heard=True),
        LangTurn("de", "e.wav", "guten tag", "", None, "", None, None, "busy", busy="breaker"),  # no final came
    ]
    table = summary(turns, ["en", "de"])
    assert table[0] == LangRow("en", 2, 2, 2, wer=0.0, detected=1.0, reply_correct=0.5, v2v_p50=1000.0)
    assert (table[1].turns, table[1].heard, table[1].answered) == (3, 2, 1)
    assert table[1].wer == pytest.approx(2 / 8) and table[1].detected == 0.5  # the unheard turn counts in neither
    assert table[1].reply_correct == 1.0 and table[1].v2v_p50 == 1500.0
    text = format_table(table)
    assert text.splitlines()[0] == ("| language | turns | heard | answered | WER | detected | reply in language | "
                                    "v2v p50 ms |")
    assert _rows(text) == [["en", "2", "2", "2", "0.000", "100 %", "50 %", "1000"],
                           ["de", "3", "2", "1", "0.250", "50 %", "100 %", "1500"]]
    assert _rows(format_table(summary([], ["fr"]))) == [["fr", "0", "0", "0", "–", "–", "–", "–"]]


def test_the_server_gets_the_multilingual_asr_unless_told_otherwise():
    assert serve_args([]) == ["--asr-model", "base"]
    assert serve_args([], ["en", "de"]) == ["--asr-model", "base", "--voice", "en=joe", "--voice", "de=espeak:de"]
    assert serve_args(["--voice", "de=/v.onnx"], ["en", "de"]) == ["--asr-model", "base", "--voice", "de=/v.onnx"]
    assert serve_args(["--asr-model", "tiny.en"]) == ["--asr-model", "tiny.en"]
    assert serve_args(["--asr-model=/m", "--slo-ms", "9"]) == ["--asr-model=/m", "--slo-ms", "9"]


def test_cli_flags_and_main_prints_the_table(monkeypatch, capsys):
    args = build_parser().parse_args(["bench", "voice", "--lang", "en", "de", "--max-clips", "1"])
    assert args.lang == ["en", "de"] and args.max_clips == 1
    seen: dict = {}

    async def fake_run_turns(url, audio_dir, clips, repeat=1):  # the orchestration; no server
        seen["clips"] = {lang: [r["file"] for r in rows] for lang, rows in clips.items()}
        return [LangTurn("de", "de_fleurs_001.wav", "er griff", "Er griff.", "de", "Ja.", "de", 1234.0,
                         "answered", heard=True)]

    monkeypatch.setattr(vl, "start_server", lambda llm, port, extra, log=None: seen.setdefault("extra", extra))
    monkeypatch.setattr(vl, "stop_server", lambda proc: None)
    monkeypatch.setattr(vl, "run_turns", fake_run_turns)
    assert vl.lang_main(args) == 0
    assert seen["extra"] == ["--asr-model", "base", "--voice", "en=joe", "--voice", "de=espeak:de"]
    assert seen["clips"] == {"en": ["en_jfk_inaugural_1961.wav"], "de": ["de_fleurs_001.wav"]}
    out = capsys.readouterr().out
    assert "| de | 1 | 1 | 1 | 0.000 | 100 % | 100 % | 1234 |" in out and "| en | 0 | 0 | 0 |" in out
    assert vl.lang_main(Namespace(**{**vars(args), "lang": ["xx"]})) == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_run_prints_the_table():
    """One German clip through a real server (multilingual Whisper base, SmolLM2: its reply
    language is not asserted here; tests/test_reply_language_models.py does that with the
    default LLM)."""
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "voice", "--lang", "de", "--max-clips", "1",
                          "--serve-args", "--slo-ms 600000 --breaker-slow-ms llm=600000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=850)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = _rows(out.stdout)
    assert rows[0][:4] == ["de", "1", "1", "1"], out.stdout
    assert float(rows[0][4]) < 0.5 and rows[0][5] == "100 %", out.stdout  # heard as German, mostly right
    assert rows[0][7].isdigit(), out.stdout
