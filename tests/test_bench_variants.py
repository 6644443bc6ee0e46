"""``voxpipe bench voice --variant NAME=SERVE_ARGS``: parsing, log names and the side-by-side
table on synthetic rows (fast; the real run is the bench itself)."""

from __future__ import annotations

import pytest

from bench.voice_variants import COLUMNS, format_table, parse_variants, variant_log
from cli.main import build_parser


def test_variants_are_parsed_like_a_shell_in_order():
    got = parse_variants(["piper=", "coqui=--tts coqui:/tmp/my vits", "remote=--llm 'openai:http://h:1/v1#m' -x"])
    assert got == [("piper", []), ("coqui", ["--tts", "coqui:/tmp/my", "vits"]),
                   ("remote", ["--llm", "openai:http://h:1/v1#m", "-x"])]


@pytest.mark.parametrize(("items", "says"), [
    (["piper"], "expected NAME=SERVE_ARGS"), (["=--tts x"], "expected NAME=SERVE_ARGS"),
    (["a b=--x"], "expected NAME=SERVE_ARGS"), (["a=", "a=--x"], "given twice"), (["a=--x 'open"], "quotation"),
])
def test_bad_variants_are_refused_with_the_reason(items, says):
    with pytest.raises(ValueError) as err:
        parse_variants(items)
    assert says in str(err.value), str(err.value)


def test_cli_takes_repeated_variants():
    args = build_parser().parse_args(["bench", "voice", "--sessions", "1", "--variant", "piper=",
                                 "--variant", "coqui=--tts coqui:/tmp/v"])
    assert args.variant == ["piper=", "coqui=--tts coqui:/tmp/v"] and args.sessions == [1]
    assert build_parser().parse_args(["bench", "voice"]).variant == []


def test_each_variant_logs_to_its_own_file():
    assert variant_log("/tmp/serve.log", "coqui") == "/tmp/serve.coqui.log"
    assert variant_log(None, "coqui") is None


def test_table_has_a_row_per_variant_and_says_why_one_failed():
    def row(name: str, first_audio: float, rtf: float) -> dict:
        stats = {k: (1.0, 2.0) for k, _ in COLUMNS} | {"first_audio": (first_audio, first_audio + 10),
                                                        "tts_rtf": (rtf, rtf * 2)}
        return {"variant": name, "sessions": 1, "responses": 8, "busy": 0, **stats}

    text = format_table([row("piper", 310.0, 0.125), row("coqui", 95.0, 0.0421),
                         {"variant": "broken", "error": "server exited"}])
    lines = text.splitlines()
    assert lines[0].startswith("| variant | sessions |") and "first audio" in lines[0] and "TTS RTF" in lines[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [c[0] for c in cells] == ["piper", "coqui", "broken"]
    assert cells[0][4:6] == ["310 / 320", "0.125 / 0.250"] and cells[1][4:6] == ["95 / 105", "0.042 / 0.084"]
    assert "failed: server exited" in lines[4] and all(len(c) == len(cells[0]) for c in cells)
