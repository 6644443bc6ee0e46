"""``--llm openai:URL`` relays tools (pipeline/llm/remote.py, pipeline/llm/remote_calls.py):
:class:`OpenAiLlm` against a small OpenAI-compatible server on loopback that records each
request and streams a scripted answer, chunk by chunk, as Server-Sent Events — the wire
format of vLLM, llama.cpp's server and OpenAI (``tool_calls`` deltas: the first of a call
with its index, id and name, then pieces of ``arguments``). What comes out of the stream is
read as every consumer reads it (:class:`~pipeline.tools.reply.ToolReplyReader`); the last
test runs a whole voice session turn through it. The real remote server (``transformers
serve``) is tests/test_llm_remote.py's."""

from __future__ import annotations

import http.server
import json
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pipeline.config import ToolsConfig, VoxpipeConfig
from pipeline.engines import open_tools
from pipeline.llm.counting import estimate_tokens
from pipeline.llm.remote import OpenAiLlm
from pipeline.llm.remote_calls import StreamedCalls
from pipeline.llm.types import FinishReason, GenRequest, RemoteLlmSpec
from pipeline.tools.render import assistant_message, tool_message
from pipeline.tools.reply import ToolReplyReader
from pipeline.tools.types import Text, ToolCall, ToolCallError, ToolCallFault, ToolSpec
from tests.fake_server import fake_server
from tests.fakes import fake_engines
from tests.wsclient import Client

CALC = ToolSpec("calculate", "Work out an arithmetic expression.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
TIMER = ToolSpec("set_timer", "Set a timer.",
                 {"type": "object", "properties": {"minutes": {"type": "number"}}, "required": ["minutes"]})
DEADLINE_S = 60.0


def chunk(delta: dict | None = None, finish: str | None = None, **extra: Any) -> dict:
    """One ``chat.completion.chunk`` with one choice."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


def call_delta(index: int | None = None, *, id: str | None = None, name: str | None = None,
               arguments: Any = None) -> dict:
    """One ``tool_calls`` item of a delta (only the fields given)."""
    fn = {k: v for k, v in (("name", name), ("arguments", arguments)) if v is not None}
    out: dict[str, Any] = {"function": fn}
    if index is not None:
        out["index"] = index
    if id is not None:
        out.update(id=id, type="function")
    return out


def pieces(*items: dict, finish: str = "tool_calls") -> list[dict]:
    """An answer: one chunk per ``tool_calls`` item, the last with ``finish``, then usage."""
    return [chunk({"role": "assistant"}), *(chunk({"tool_calls": [item]}) for item in items), chunk(finish=finish),
            {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
             "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}}]


class Remote:
    """The fake server's state: the requests' JSON bodies, the answers still to give (each a
    list of chunks; a text reply when none is left)."""

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.answers: queue.Queue[list[dict]] = queue.Queue()
        self.base = ""


@contextmanager
def remote_server() -> Iterator[Remote]:
    remote = Remote()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "created": 0,
                                                           "owned_by": "x"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            remote.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            try:
                answer = remote.answers.get_nowait()
            except queue.Empty:
                answer = [chunk({"role": "assistant", "content": "Okay."}), chunk(finish="stop")]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for c in answer:
                self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    remote.base = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        yield remote
    finally:
        httpd.shutdown()
        httpd.server_close()


class Guard:
    """The LLM breaker as the stage sees it: records each outcome."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, bool]] = []

    def permit(self) -> bool:
        return True

    def record(self, duration_s: float, failed: bool) -> None:
        self.calls.append((duration_s, failed))


@pytest.fixture
def remote():
    with remote_server() as r:
        yield r


@pytest.fixture
def llm(remote):
    stage = OpenAiLlm(RemoteLlmSpec(remote.base, "m"), estimate_tokens, slots=2, queue_size=2, timeout_s=20)
    stage.guard = Guard()
    stage.start()
    yield stage
    stage.stop()


async def ask(llm: OpenAiLlm, req: GenRequest) -> tuple[list[str], Any]:
    """The stream's deltas (pieces the reader was slow to take come joined) and its stats."""
    stream = llm.submit(req)
    return [d async for d in stream], stream.stats


def read(deltas: list[str], specs=(CALC, TIMER)) -> list:
    """What a consumer reads of the deltas, fed as they came."""
    reader = ToolReplyReader(specs)
    items = [item for d in deltas for item in reader.feed(d)]
    return items + reader.finish()


# ---- what goes to the server -------------------------------------------------------------------


@pytest.mark.parametrize(("choice", "wire"), [
    ("auto", "auto"), ("required", "required"), ("none", "none"),
    ("set_timer", {"type": "function", "function": {"name": "set_timer"}}),
])
async def test_tools_tool_choice_and_earlier_calls_reach_the_server_in_openais_format(remote, llm, choice, wire):
    earlier = ToolCall("call_1", "calculate", {"expression": "6*7"}, "")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Six times seven?"},
                assistant_message([earlier]), tool_message(earlier, {"result": 42}),
                {"role": "user", "content": "And a timer for five minutes."}]
    deltas, _ = await ask(llm, GenRequest(messages=messages, max_new_tokens=16, tools=(CALC, TIMER),
                                          tool_choice=choice))
    assert "".join(deltas) == "Okay."
    [sent] = remote.requests
    assert sent["tools"] == [CALC.to_openai(), TIMER.to_openai()] and sent["tool_choice"] == wire
    assistant, result = sent["messages"][2:4]
    assert assistant["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "calculate", "arguments": '{"expression": "6*7"}'}}]  # a JSON string, as OpenAI's API has it
    assert result == {"role": "tool", "tool_call_id": "call_1", "name": "calculate", "content": '{"result": 42}'}
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"expression": "6*7"}  # the request kept as it was
    assert sent["stream"] is True and sent["model"] == "m"


async def test_without_tools_none_are_sent(remote, llm):
    await ask(llm, GenRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=8))
    [sent] = remote.requests
    assert "tools" not in sent and "tool_choice" not in sent


# ---- what comes back ---------------------------------------------------------------------------


async def test_streamed_tool_calls_come_out_as_call_blocks_the_reader_reads(remote, llm):
    """Text, then two calls whose deltas interleave (id+name first, the arguments in pieces):
    the text as it came, then one block per call in the order the calls started; the
    breaker hears of a success; usage counts."""
    remote.answers.put([
        chunk({"role": "assistant", "content": "Sure. "}),
        chunk({"tool_calls": [call_delta(0, id="call_a", name="calculate", arguments="")]}),
        chunk({"tool_calls": [call_delta(0, arguments='{"expre')]}),
        chunk({"tool_calls": [call_delta(1, id="call_b", name="set_timer", arguments='{"min')]}),
        chunk({"tool_calls": [call_delta(0, arguments='ssion": "6*7"}')]}),
        chunk({"tool_calls": [call_delta(1, arguments='utes": 5}')]}),
        chunk(finish="tool_calls"),
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
         "usage": {"prompt_tokens": 30, "completion_tokens": 12, "total_tokens": 42}},
    ])
    deltas, stats = await ask(llm, GenRequest(messages=[{"role": "user", "content": "Go."}], tools=(CALC, TIMER)))
    # (the stream coalesces what its reader has not taken yet: the text may come with the calls)
    assert "".join(deltas) == ('Sure. <tool_call>\n{"name": "calculate", "arguments": {"expression": "6*7"}}\n'
                               '</tool_call><tool_call>\n{"name": "set_timer", "arguments": {"minutes": 5}}\n'
                               '</tool_call>')
    items = read(deltas)
    assert "".join(i.text for i in items if isinstance(i, Text)) == "Sure. "
    first, second = [i for i in items if not isinstance(i, Text)]
    assert isinstance(first, ToolCall) and (first.name, first.arguments) == ("calculate", {"expression": "6*7"})
    assert isinstance(second, ToolCall) and (second.name, second.arguments) == ("set_timer", {"minutes": 5})
    assert stats.finish_reason is FinishReason.STOP and (stats.prompt_tokens, stats.output_tokens) == (30, 12)
    assert stats.ttft_ms > 0 and [failed for _, failed in llm.guard.calls] == [False]


async def test_a_reply_that_is_only_a_call_tells_the_breaker_and_has_a_ttft(remote, llm):
    """Once, a reply of tool calls alone told the LLM breaker nothing (a half-open breaker's
    probe never came back) and had no time to first token."""
    remote.answers.put(pieces(call_delta(0, id="call_a", name="set_timer", arguments=""),
                              call_delta(0, arguments='{"minutes": '), call_delta(0, arguments="5}")))
    deltas, stats = await ask(llm, GenRequest(messages=[{"role": "user", "content": "Timer."}], tools=(TIMER,),
                                              tool_choice="required"))
    [item] = read(deltas)
    assert isinstance(item, ToolCall) and item.arguments == {"minutes": 5}
    assert stats.ttft_ms is not None and stats.ttft_ms > 0
    assert [failed for _, failed in llm.guard.calls] == [False]


@pytest.mark.parametrize("arguments", ['{"expression": 6*7', "expression=6*7", "{'expression': '6*7'}"])
async def test_a_call_with_arguments_that_are_not_json_is_a_botched_call(remote, llm, arguments):
    remote.answers.put(pieces(call_delta(0, id="call_a", name="calculate", arguments=""),
                              call_delta(0, arguments=arguments)))
    deltas, stats = await ask(llm, GenRequest(messages=[{"role": "user", "content": "Go."}], tools=(CALC,)))
    [item] = read(deltas)
    assert isinstance(item, ToolCallError) and item.reason is ToolCallFault.NOT_JSON, item
    assert arguments in item.raw  # what the server sent, for the repair note and the logs
    assert stats.finish_reason is FinishReason.STOP and [f for _, f in llm.guard.calls] == [False]


async def test_servers_that_stray_from_the_format_are_read_too(remote, llm):
    """No ``index`` (an id starts a call; a repeated id or none goes on with the latest), and
    ``arguments`` as an object rather than a JSON string."""
    remote.answers.put(pieces(call_delta(id="call_a", name="calculate", arguments='{"expression": '),
                              call_delta(id="call_a", arguments='"1+1"}'),
                              call_delta(id="call_b", name="set_timer", arguments={"minutes": 2})))
    deltas, _ = await ask(llm, GenRequest(messages=[{"role": "user", "content": "Go."}], tools=(CALC, TIMER)))
    first, second = read(deltas)
    assert isinstance(first, ToolCall) and first.arguments == {"expression": "1+1"}
    assert isinstance(second, ToolCall) and second.arguments == {"minutes": 2}


def test_streamed_calls_without_an_index_or_an_id_add_to_the_latest():
    from types import SimpleNamespace as NS

    calls = StreamedCalls()
    calls.add([NS(index=None, id=None, function=NS(name="calculate", arguments='{"expression"'))])
    calls.add([NS(index=None, id=None, function=NS(name=None, arguments=': "2"}'))])
    calls.add([NS(index=None, id=None, function=None)])
    assert calls.calls == [["calculate", '{"expression": "2"}']]


# ---- a voice session over the remote server ----------------------------------------------------


async def test_a_session_runs_the_remote_models_call_and_sends_the_result_back(remote, llm):
    """A typed turn: the remote model calls the calculator (streamed in pieces); the session
    announces and runs it, then asks the remote server again with the call (arguments a JSON
    string) and its result, and says what it answers."""
    remote.answers.put(pieces(call_delta(0, id="call_x", name="calculate", arguments=""),
                              call_delta(0, arguments='{"expression": '), call_delta(0, arguments='"6*7"}')))
    remote.answers.put([chunk({"role": "assistant", "content": "It is "}), chunk({"content": "42."}),
                        chunk(finish="stop")])
    cfg = VoxpipeConfig(tools=ToolsConfig(plugin="tests.tool_plugins:TOOLS", builtin=("calculator",)))
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, Client(srv.ws) as c:
        await c.start()
        await c.send_json({"type": "text.input", "text": "What is six times seven?"})
        done = await c.wait_for("response.done", DEADLINE_S)
    assert done["text"] == "It is 42.", c.conv.events
    [announced] = c.conv.of("tool.call")
    assert (announced["name"], announced["arguments"], announced["runs_on"]) == (
        "calculate", {"expression": "6*7"}, "server")
    [output] = c.conv.of("tool.output")
    assert json.loads(output["output"]) == {"result": 42} and output["error"] is None
    first, second = remote.requests
    assert {t["function"]["name"] for t in first["tools"]} >= {"calculate", "switch_light"}
    assistant, result, nudge = second["messages"][-3:]  # nudge: SAY_RESULT
    assert assistant["tool_calls"][0]["function"] == {"name": "calculate", "arguments": '{"expression": "6*7"}'}
    assert result["role"] == "tool" and result["tool_call_id"] == announced["call_id"]
    assert json.loads(result["content"]) == {"result": 42}
