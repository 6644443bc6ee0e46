"""The web page (web/tools.js) shows a reply's tool calls: the real server over fake stages
whose scripted LLM calls the server's tools (tests/tool_plugins.py and the calculator
built-in), in headless Chromium as in tests/test_web_ui.py."""

from __future__ import annotations

import json

from pipeline.config import ToolsConfig, VoxpipeConfig
from pipeline.engines import open_tools
from tests.fake_server import fake_server_thread
from tests.fakes import FakeLlm, LlmReply, fake_engines
from tests.test_web import launch
from tests.test_web_ui import new_page, send_text, shots, until

# The reply bubbles' tool lines, read in the page.
TOOL_LINES = """() => [...document.querySelectorAll('#conversation .msg.assistant')].map((m) =>
  [...m.querySelectorAll('.tools .tool')].map((t) => ({text: t.innerText, error: t.classList.contains('error'),
                                                       pending: t.classList.contains('pending'),
                                                       title: t.title})))"""


def call(name: str, **arguments) -> str:
    """A call block as Qwen2.5 writes one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tool_calls_and_their_results_show_under_the_reply():
    """A good call shows as ``⚙ name(args) → result`` under its reply's text (the call's
    markup never in the text); a tool that raises shows its error, marked as one; the page's
    ``window.voxpipe.toolCalls`` holds both; the event log has a line for each event."""
    llm = FakeLlm([LlmReply.of("Let me see. ", "<tool_", "call>\n", '{"name": "calculate", "arguments": ',
                               '{"expression": "6*7"}}\n</tool_call>'),
                   LlmReply.of("It is 42."),
                   LlmReply.of(call("explode", reason="on purpose")),
                   LlmReply.of("That did not work.")])
    cfg = VoxpipeConfig(tools=ToolsConfig(plugin="tests.tool_plugins:TOOLS", builtin=("calculator",)))
    with launch() as b, fake_server_thread(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv:
        page, errors = new_page(b, srv.http)
        send_text(page, "What is six times seven?")
        s = until(page, "s.replies.length === 1 && s.replies[0].meta.includes('tok')", "the first reply done")
        assert s["replies"][0]["text"] == "Let me see. It is 42.", s
        [[good]] = page.evaluate(f"({TOOL_LINES})()")
        assert good["text"] == '⚙ calculate(expression="6*7") → {"result": 42}', good
        assert not good["error"] and not good["pending"]

        send_text(page, "Blow it up.")
        s = until(page, "s.replies.length === 2 && s.replies[1].meta.includes('tok')", "the second reply done")
        assert s["replies"][1]["text"] == "That did not work.", s
        first, [bad] = page.evaluate(f"({TOOL_LINES})()")
        assert first == [good]  # each reply keeps its own calls
        assert bad["text"].startswith('⚙ explode(reason="on purpose") → error: ') and "exploded on purpose" in \
            bad["text"] and bad["error"], bad
        shots(page, "20-tool-calls")

        calls = page.evaluate("window.voxpipe.toolCalls")
        assert [(c["response_id"], c["name"], c["runs_on"], c["error"] is None) for c in calls] == [
            (1, "calculate", "server", True), (2, "explode", "server", False)]
        assert json.loads(calls[0]["output"]) == {"result": 42} and calls[0]["arguments"] == {"expression": "6*7"}
        log = page.evaluate("[...document.querySelectorAll('#log li')].map((li) => li.innerText)")
        assert any('← tool.call #1 calculate(expression="6*7") (runs on the server)' in line for line in log), log
        assert any("← tool.output #2 explode: error: " in line for line in log), log
        assert not errors, errors
