"""Tool calls in a voice session (pipeline/session/tool_turn.py, pipeline/session/tools.py)
through the real server on loopback, over a scripted LLM (tests/fakes.py): the orchestration
alone — which rounds run, what the wire says, what a bad call or a bad tool does to the
session and to others. The tools are real functions (tests/tool_plugins.py, loaded as
``--tools`` loads them); real models calling tools: tests/test_tools_real.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline import metrics
from pipeline.config import ToolsConfig, VoxpipeConfig
from pipeline.engines import open_tools
from pipeline.session.tool_turn import APOLOGY, FILLER, SAY_RESULT
from tests import tool_plugins
from tests.fake_server import fake_server
from tests.fakes import Delta, FakeLlm, LlmReply, fake_engines
from tests.test_openai_api import nested
from tests.wsclient import Client

DEADLINE_S = 60.0
PLUGIN = "tests.tool_plugins:TOOLS"


def call(name: str, **arguments) -> str:
    """A call block as Qwen2.5 writes one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def config(**tools) -> VoxpipeConfig:
    return VoxpipeConfig(tools=ToolsConfig(plugin=PLUGIN, builtin=("calculator",), **tools))


async def ask(c: Client, text: str) -> dict:
    """A typed turn: its ``response.done``."""
    n = len(c.conv.events)
    await c.send_json({"type": "text.input", "text": text})
    return await c.wait_for(lambda e: e["type"] == "response.done" and c.conv.events.index(e) >= n, DEADLINE_S)


def events(c: Client, kind: str) -> list[dict]:
    return [e for e in c.conv.events if e["type"] == kind]


async def test_a_server_tool_runs_and_the_model_says_its_result():
    llm = FakeLlm([LlmReply.of("Sure. ", "<tool_", "call>\n", '{"name": "calculate", "arguments": ',
                               '{"expression": "6*7"}}\n</tool_call>'),
                   LlmReply.of("It is 42.")])
    cfg = config()
    ran = metrics.TOOL_CALLS.labels("server", "ok")._value.get()
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.start()
        done = await ask(c, "What is six times seven?")
    assert metrics.TOOL_CALLS.labels("server", "ok")._value.get() == ran + 1
    assert done["text"] == "Sure. It is 42."  # the markup is never spoken nor shown
    assert "".join(e["delta"] for e in events(c, "response.text.delta")) == "Sure. It is 42."
    [announced] = events(c, "tool.call")
    assert (announced["name"], announced["arguments"], announced["runs_on"]) == (
        "calculate", {"expression": "6*7"}, "server")
    [output] = events(c, "tool.output")
    assert output["call_id"] == announced["call_id"] and json.loads(output["output"]) == {"result": 42}
    assert output["error"] is None
    first, second = llm.requests
    assert {t.name for t in first.tools} >= {"calculate", "switch_light"} and first.tool_choice == "auto"
    assistant, result, nudge = second.messages[-3:]
    assert assistant["tool_calls"][0]["function"] == {"name": "calculate", "arguments": {"expression": "6*7"}}
    assert result == {"role": "tool", "tool_call_id": announced["call_id"], "name": "calculate",
                      "content": output["output"]}
    assert nudge == {"role": "user", "content": SAY_RESULT}  # words, please: not the JSON back
    assert second.tool_choice == "auto"  # round 2 of 3 may still call


@pytest.mark.parametrize("bad", [
    "<tool_call>\n{name: calculate}\n</tool_call>",  # not JSON
    call("launch_rocket", when="now"),  # no such tool
    call("switch_light", room="kitchen", state="purple"),  # the schema's enum says no
    '{"name": "switch_light"',  # a bare JSON reply, cut off
])
async def test_a_bad_call_gets_one_repair_then_an_apology_and_the_session_goes_on(bad):
    llm = FakeLlm([LlmReply.of(bad), LlmReply.of(bad), LlmReply.of("Hello again.")])
    cfg = config()
    botched = sum(metrics.TOOL_BOTCHED.labels(f)._value.get() for f in ("not_json", "unknown_tool", "schema"))
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.start()
        done = await ask(c, "Do the thing.")
        assert sum(metrics.TOOL_BOTCHED.labels(f)._value.get()
                   for f in ("not_json", "unknown_tool", "schema")) == botched + 2
        assert done["text"] == APOLOGY and not events(c, "tool.call")
        repair = llm.requests[1].messages[-1]
        assert repair["role"] == "user" and repair["content"].startswith("Your tool call was not valid")
        assert (await ask(c, "Hi."))["text"] == "Hello again."  # nothing lost
    assert not events(c, "error")


async def test_a_repaired_call_runs():
    llm = FakeLlm([LlmReply.of(call("switch_light", room="hall")),  # "state" missing
                   LlmReply.of(call("switch_light", room="hall", state="off")), LlmReply.of("Done.")])
    cfg = config()
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.start()
        done = await ask(c, "Lights off in the hall.")
    assert done["text"] == "Done."
    assert "state" in llm.requests[1].messages[-1]["content"]  # the repair note names what was wrong
    [output] = events(c, "tool.output")
    assert json.loads(output["output"]) == {"room": "hall", "state": "off"}


@pytest.mark.parametrize(("name", "arguments", "error"), [
    ("explode", {"reason": "now"}, "explode failed: RuntimeError: exploded now"),
    ("weird", {}, "weird returned what JSON cannot hold"),
    ("hang", {}, "hang did not answer within 0.5 s"),
])
async def test_a_tool_that_raises_returns_junk_or_hangs_is_reported_to_the_model(name, arguments, error):
    llm = FakeLlm([LlmReply.of(call(name, **arguments)), LlmReply.of("That did not work.")])
    cfg = config(timeout_s=0.5, filler_ms=0)
    tool_plugins.HANG.clear()
    try:
        async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
            await c.start()
            done = await ask(c, "Try it.")
    finally:
        tool_plugins.HANG.set()
    assert done["text"] == "That did not work."
    [output] = events(c, "tool.output")
    assert output["error"].startswith(error) and json.loads(output["output"]) == {"error": output["error"]}
    assert json.loads(llm.requests[1].messages[-2]["content"]) == {"error": output["error"]}


async def test_a_slow_tool_gets_a_filler_once_and_the_last_round_offers_no_tool():
    llm = FakeLlm([LlmReply.of(call("slow", seconds=0.4)), LlmReply.of(call("slow", seconds=0.4)),
                   LlmReply.of("Both done.")])
    cfg = config(filler_ms=100)
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.start()
        done = await ask(c, "Two slow things.")
    assert done["text"] == f"{FILLER} Both done."
    assert len(events(c, "tool.output")) == 2
    assert [r.tool_choice for r in llm.requests] == ["auto", "auto", "none"]


async def test_a_client_tool_waits_for_its_result_and_a_stray_result_is_an_error():
    llm = FakeLlm([LlmReply.of(call("open_door", door="front")), LlmReply.of("The door is open.")])
    cfg = config()
    door = {"name": "open_door", "description": "Open a door.",
            "parameters": {"type": "object", "properties": {"door": {"type": "string"}}, "required": ["door"]}}
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.start(tools=[door])
        await c.send_json({"type": "text.input", "text": "Open the front door."})
        announced = await c.wait_for("tool.call", DEADLINE_S)
        assert announced["runs_on"] == "client" and announced["arguments"] == {"door": "front"}
        await c.send_json({"type": "tool.result", "call_id": "call_nobody", "output": "?"})
        await c.wait_for(lambda e: e["type"] == "error" and e["code"] == "bad_event", DEADLINE_S)
        await c.send_json({"type": "tool.result", "call_id": announced["call_id"], "output": '{"open": true}'})
        done = await c.wait_for("response.done", DEADLINE_S)
    assert done["text"] == "The door is open."
    assert events(c, "tool.output")[0]["output"] == '{"open": true}'
    assert "open_door" in {t.name for t in llm.requests[0].tools}


@pytest.mark.parametrize("tools", [
    [{"name": "calculate"}],  # the server's own name
    [{"name": "a"}, {"name": "a"}],
    [{"name": "b", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}],
    [{"name": "deep", "parameters": nested(100)}],  # closed the session with 1011 (RecursionError)
])
async def test_tools_that_cannot_be_offered_are_refused_at_session_start(tools):
    cfg = config()
    async with fake_server(cfg, fake_engines(tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.send_json({"type": "session.start", "tools": tools})
        err = await c.wait_for("error", DEADLINE_S)
        assert err["code"] == "bad_event" and not err["fatal"]
        await c.start()  # the session is still there and starts without them


async def test_cancel_stops_a_running_tool_and_another_session_is_not_held_up():
    llm = FakeLlm([LlmReply.of(call("hang"))], default=LlmReply([Delta("Fine.", 0.0)]))
    cfg = config(timeout_s=30.0, filler_ms=0)
    tool_plugins.HANG.clear()
    try:
        async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, \
                Client(srv.ws) as a, Client(srv.ws) as b:
            await a.start()
            await b.start()
            await a.send_json({"type": "text.input", "text": "Hang."})
            await a.wait_for("tool.call", DEADLINE_S)
            assert (await ask(b, "Hello?"))["text"] == "Fine."  # while a's tool hangs
            await a.send_json({"type": "response.cancel"})
            cancelled = await a.wait_for("response.cancelled", DEADLINE_S)
            assert cancelled["reason"] == "client" and not events(a, "tool.output")
            assert (await ask(a, "Still there?"))["text"] == "Fine."
            await asyncio.sleep(0)
    finally:
        tool_plugins.HANG.set()
