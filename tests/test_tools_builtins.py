"""The built-in tools (pipeline/tools/builtins.py) and the toolbox that runs a server's tools
(pipeline/tools/toolbox.py): loading a plugin, a call's time limit, what a call's result
becomes. Real functions, no model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from pipeline.tools.builtins import calculate, duration_words, get_time, set_timer
from pipeline.tools.toolbox import MAX_RESULT_CHARS, Toolbox, load_tools
from pipeline.tools.types import ToolCall


@pytest.mark.parametrize(("expression", "result"), [
    ("12 * 7", 84), ("12 * (3 + 4) / 2", 42), ("2 ** 10", 1024), ("17 % 5", 2), ("15% * 80", 12),
    ("15% of 80", 12), ("7 ÷ 2", 3.5), ("3 × 4", 12), ("2^3", 8), ("-(2 + 3)", -5), ("0.1 + 0.2", 0.30000000000000004),
])
def test_calculate(expression, result):
    assert calculate(expression) == {"result": result}


@pytest.mark.parametrize(("expression", "words"), [
    ("__import__('os').system('true')", "only numbers"), ("x + 1", "only numbers"), ("1 / 0", "division by zero"),
    ("((10**1000)**1000)**1000", "too large"), ("2 +", "not an arithmetic expression"), ("1" * 201, "over 200"),
    ("1e308 * 10", "not a finite number"), ("'a' * 3", "only numbers"),
])
def test_calculate_refuses_what_it_must(expression, words):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=words):
        calculate(expression)
    assert time.perf_counter() - t0 < 5  # a guard against a runaway power, not a speed check


def test_timer_and_time():
    assert set_timer(minutes=5)["seconds"] == 300 and set_timer(seconds=90, label="tea")["label"] == "tea"
    for bad in ({}, {"minutes": -1}, {"minutes": 60 * 25}):
        with pytest.raises(ValueError):
            set_timer(**bad)
    assert set(get_time()) == {"time", "date", "timezone"}


def test_a_timer_result_carries_a_sentence_to_say():
    """A small model reads a result's first sentence back; bare fields got "The result is 37:27."."""
    five = set_timer(minutes=5)
    assert five["summary"].startswith("A timer for 5 minutes is set. It rings at ")
    assert five["summary"].endswith(five["rings_at"][:5] + ".")
    assert set_timer(seconds=90, label="tea")["summary"].startswith("A timer for 1 minute and 30 seconds (tea) is set.")
    assert [duration_words(s) for s in (1, 10, 60, 3661, 7200)] == [
        "1 second", "10 seconds", "1 minute", "1 hour, 1 minute and 1 second", "2 hours"]


def test_load_tools_names_what_is_wrong(tmp_path):
    assert [s.name for s in load_tools(None, ("time", "calculator")).specs] == ["get_time", "calculate"]
    assert [s.name for s in load_tools("tests.tool_plugins:TOOLS").specs][:2] == ["switch_light", "explode"]
    plugin = tmp_path / "mine.py"
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n")
    with pytest.raises(ValueError, match="cannot import .*SystemExit"):  # was: serve exited 0, silently
        load_tools(f"{tmp_path / 'quits.py'}:X")
    plugin.write_text('def ping() -> str:\n    """Ping."""\n    return "pong"\n\nONE = ping\nNOT = 3\n'
                      'def bad(x):\n    """No hint."""\n')
    assert [s.name for s in load_tools(f"{plugin}:ONE").specs] == ["ping"]
    for spec, words in [(None, "unknown built-in"), ("nosuchmodule_xyz:T", "cannot import"),
                        (f"{plugin}:MISSING", "has no"), (f"{plugin}:NOT", "must be a function"),
                        (f"{plugin}:bad", "no type hint"), ("justamodule", "module:object"),
                        (str(tmp_path / "none.py") + ":X", "cannot import")]:
        with pytest.raises(ValueError, match=words):
            load_tools(spec, ("alarm",) if spec is None else ())


async def test_a_call_s_result_extra_arguments_and_time_limit():
    def big() -> list[int]:
        """A long result."""
        return list(range(10_000))

    def echo(text: str) -> str:
        """Echo.

        Args:
            text: what to say.
        """
        return text

    async def sleepy() -> str:
        """Sleeps."""
        await asyncio.sleep(30)
        return "late"

    box = Toolbox([big, echo, sleepy], timeout_s=0.3)
    r = await box.run(ToolCall("c1", "big", {}))
    assert r.error is None and len(r.output) == MAX_RESULT_CHARS + 1 and r.output.endswith("…")
    r = await box.run(ToolCall("c2", "echo", {"text": "hi", "type": "object"}))  # an extra key a model copied
    assert (r.output, r.error) == ("hi", None)
    def stuck() -> str:
        """Never returns (until the test ends)."""
        release.wait(60)
        return "late"

    release = threading.Event()
    stuck_box = Toolbox([stuck], timeout_s=0.2)
    try:
        r = await stuck_box.run(ToolCall("c5", "stuck", {}))
        assert r.error == "stuck did not answer within 0.2 s"
        # a hung tool's thread must not keep a stopped server from exiting
        assert all(t.daemon for t in threading.enumerate() if t.name.startswith("voxpipe-tool-stuck"))
        assert any(t.name.startswith("voxpipe-tool-stuck") for t in threading.enumerate())
    finally:
        release.set()
    r = await box.run(ToolCall("c3", "sleepy", {}))
    assert r.error == "sleepy did not answer within 0.3 s" and json.loads(r.output) == {"error": r.error}
    r = await box.run(ToolCall("c4", "nothing", {}))
    assert r.error is not None and "no tool named" in r.error
    with pytest.raises(ValueError, match="two tools"):
        Toolbox([echo, echo])
    box.close()
