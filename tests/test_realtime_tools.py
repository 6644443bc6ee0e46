"""Function calling on ``/v1/realtime`` (server/realtime/calls.py, docs/REALTIME.md
"Function calling"), driven by the official ``openai`` package's realtime clients over a
scripted LLM (tests/fakes.py): a call ends its Realtime response; the client's
``function_call_output`` + ``response.create`` start a new response in which the same
voxpipe reply goes on with the result."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.config import ToolsConfig, VoxpipeConfig
from pipeline.engines import open_tools
from tests.fake_server import fake_server
from tests.fakes import FakeLlm, LlmReply, fake_engines
from tests.test_openai_api import nested
from tests.test_realtime import client, collect, is_done, types

DEADLINE_S = 60.0
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
SCOPED = ("response.output_item.", "response.content_part.", "response.output_audio", "response.audio",
          "response.function_call_arguments.")


def call(name: str, **arguments) -> str:
    """A call block as Qwen2.5 writes one."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def config(**tools) -> VoxpipeConfig:
    return VoxpipeConfig(tools=ToolsConfig(**{"filler_ms": 0, **tools}))


def connect(port: int, dialect: str):
    c = client(port)
    return (c.beta.realtime if dialect == "beta" else c.realtime).connect(model="voxpipe")


async def ask(conn, text: str) -> None:
    await conn.conversation.item.create(item={"type": "message", "role": "user",
                                              "content": [{"type": "input_text", "text": text}]})
    await conn.response.create()


def is_error(e) -> bool:
    return e.type == "error"


def check_nesting(events) -> None:
    """Every response-scoped event lies between its response's ``response.created`` and
    ``response.done``, and responses do not overlap."""
    open_id = None
    for e in events:
        if e.type == "response.created":
            assert open_id is None, f"{e.response.id} opened inside {open_id}"
            open_id = e.response.id
        elif e.type == "response.done":
            assert e.response.id == open_id
            open_id = None
        elif e.type.startswith(SCOPED):
            assert e.response_id == open_id, (e.type, e.response_id, open_id)


@pytest.mark.parametrize("dialect", ["ga", "beta"])
async def test_a_function_call_round_trip_spans_two_responses(dialect):
    llm = FakeLlm([LlmReply.of("Let me check. ", "<tool_", "call>\n", '{"name": "get_weather", "arguments": ',
                               '{"city": "Paris"}}\n</tool_call>'),
                   LlmReply.of("It is sunny ", "in Paris.")])
    added = "conversation.item.created" if dialect == "beta" else "conversation.item.added"
    transcript = "response.audio_transcript.delta" if dialect == "beta" else "response.output_audio_transcript.delta"
    async with fake_server(config(), fake_engines(llm=llm)) as srv, connect(srv.port, dialect) as conn:
        await conn.session.update(session={"tools": [WEATHER], "tool_choice": "auto"})
        updated = (await collect(conn, lambda e: e.type == "session.updated", DEADLINE_S))[-1]
        assert [t.name for t in updated.session.tools] == ["get_weather"] and updated.session.tool_choice == "auto"
        await ask(conn, "What's the weather in Paris?")
        first = await collect(conn, is_done, DEADLINE_S)
        done = first[-1].response
        assert done.status == "completed"
        assert [i.type for i in done.output] == ["message", "function_call"]
        assert done.output[0].content[0].transcript == "Let me check. "
        fc = done.output[1]
        assert (fc.name, json.loads(fc.arguments), fc.status) == ("get_weather", {"city": "Paris"}, "completed")
        [delta] = [e for e in first if e.type == "response.function_call_arguments.delta"]
        [args_done] = [e for e in first if e.type == "response.function_call_arguments.done"]
        assert delta.call_id == args_done.call_id == fc.call_id and args_done.name == "get_weather"
        assert json.loads(args_done.arguments) == {"city": "Paris"} and args_done.output_index == 1
        added_fc = [e for e in first if e.type == "response.output_item.added" and e.item.type == "function_call"]
        assert added_fc[0].item.id == fc.id == delta.item_id and added_fc[0].output_index == 1

        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": fc.call_id,
                                                  "output": '{"sky": "sunny"}'})
        recorded = (await collect(conn, lambda e: e.type == added and e.item.type == "function_call_output",
                                  DEADLINE_S))[-1]
        assert recorded.item.call_id == fc.call_id and recorded.item.output == '{"sky": "sunny"}'
        await conn.response.create()
        second = await collect(conn, is_done, DEADLINE_S)
    again = second[-1].response
    assert again.id != done.id and again.status == "completed"
    assert again.output[0].content[0].transcript == "It is sunny in Paris."
    assert "response.created" in types(second)
    assert "".join(e.delta for e in second if e.type == transcript) == "It is sunny in Paris."
    check_nesting(first + second)
    assert "get_weather" in {t.name for t in llm.requests[0].tools}
    tool_msgs = [m for m in llm.requests[1].messages if m.get("role") == "tool"]
    assert tool_msgs and tool_msgs[-1]["content"] == '{"sky": "sunny"}'


async def test_a_client_call_gets_no_filler():
    """``--tool-filler-ms`` passes while the client runs its function: no "One moment." (it
    could only come after the result, in the next response)."""
    llm = FakeLlm([LlmReply.of(call("get_weather", city="Paris")), LlmReply.of("Sunny.")])
    async with fake_server(config(filler_ms=10), fake_engines(llm=llm)) as srv, connect(srv.port, "ga") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
        await ask(conn, "Paris?")
        fc = (await collect(conn, is_done, DEADLINE_S))[-1].response.output[-1]
        await asyncio.sleep(0.3)  # well past the filler delay
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": fc.call_id,
                                                  "output": "sunny"})
        await conn.response.create()
        done = (await collect(conn, is_done, DEADLINE_S))[-1]
    assert done.response.output[0].content[0].transcript == "Sunny."


async def test_two_calls_in_one_reply_take_three_responses():
    """A second call made while the reply waits for ``response.create`` (held, then shown
    in the next response) ends that response too; the answer comes in the third."""
    llm = FakeLlm([LlmReply.of(call("get_weather", city="Paris")), LlmReply.of(call("get_weather", city="Rome")),
                   LlmReply.of("Both sunny.")])
    async with fake_server(config(), fake_engines(llm=llm)) as srv, connect(srv.port, "ga") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
        await ask(conn, "Paris and Rome?")
        events = await collect(conn, is_done, DEADLINE_S)
        for city in ("Paris", "Rome"):
            fc = events[-1].response.output[-1]
            assert fc.type == "function_call" and json.loads(fc.arguments) == {"city": city}
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": fc.call_id,
                                                      "output": "sunny"})
            await asyncio.sleep(0.3)  # the session goes on meanwhile: what it says is held
            await conn.response.create()
            await collect(conn, is_done, DEADLINE_S, seen=events)
    dones = [e.response for e in events if e.type == "response.done"]
    assert len({d.id for d in dones}) == 3 and dones[-1].output[0].content[0].transcript == "Both sunny."
    check_nesting(events)


async def test_a_result_that_never_comes_times_out_into_a_new_response():
    """The client never answers: after ``--tool-timeout-s`` it gets an ``error`` and the
    reply goes on at once in a new response (the model told of the timeout); a late output
    is refused and the session goes on."""
    llm = FakeLlm([LlmReply.of(call("get_weather", city="Oslo")), LlmReply.of("The weather service is quiet.")])
    async with fake_server(config(timeout_s=0.5), fake_engines(llm=llm)) as srv, connect(srv.port, "ga") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
        await ask(conn, "Weather in Oslo?")
        first = await collect(conn, is_done, DEADLINE_S)
        [fc] = first[-1].response.output  # no text before the call: the call alone
        assert fc.type == "function_call"
        second = await collect(conn, is_done, DEADLINE_S)
        [err] = [e for e in second if is_error(e)]
        assert err.error.code == "function_call_timeout" and fc.call_id in err.error.message
        assert second[-1].response.output[0].content[0].transcript == "The weather service is quiet."
        check_nesting(first + second)
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": fc.call_id,
                                                  "output": "late"})
        late = (await collect(conn, is_error, DEADLINE_S))[-1]
        assert (late.error.code, late.error.param) == ("invalid_value", "item.call_id")
        await ask(conn, "Still there?")
        assert (await collect(conn, is_done, DEADLINE_S))[-1].response.output[0].content[0].transcript == "Okay."
    assert "did not answer" in llm.requests[1].messages[-2]["content"]  # [-1]: the SAY_RESULT nudge


@pytest.mark.parametrize("session, param", [
    ({"tools": "get_weather"}, "session.tools"),
    ({"tools": [{"type": "mcp", "server_label": "x"}]}, "session.tools[0]"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "session.tools[0].name"),
    ({"tools": [WEATHER, WEATHER]}, "session.tools"),  # one name twice
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}]}, "session.tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": nested(100)}]}, "session.tools"),  # was: 1011
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "session.tool_choice"),
    ({"tool_choice": {"type": "mcp", "server_label": "x"}}, "session.tool_choice"),
])
async def test_bad_tools_are_refused_and_the_session_goes_on(session, param):
    llm = FakeLlm()
    async with fake_server(config(), fake_engines(llm=llm)) as srv, connect(srv.port, "ga") as conn:
        await conn.session.update(session=session)
        err = (await collect(conn, is_error, DEADLINE_S))[-1]
        assert (err.error.code, err.error.param, err.error.type) == ("invalid_value", param, "invalid_request_error")
        await conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_nobody",
                                                  "output": "?"})
        stray = (await collect(conn, is_error, DEADLINE_S))[-1]
        assert (stray.error.code, stray.error.param) == ("invalid_value", "item.call_id")
        await ask(conn, "Hello?")
        done = (await collect(conn, is_done, DEADLINE_S))[-1]
    assert done.response.status == "completed" and llm.requests[0].tools == ()  # nothing was declared


async def test_tool_choice_reaches_the_model_and_survives_a_restart():
    llm = FakeLlm()
    async with fake_server(config(), fake_engines(llm=llm)) as srv, connect(srv.port, "ga") as conn:
        for choice in ["required", {"type": "function", "name": "get_weather"}, "none", "auto"]:
            await conn.session.update(session={"type": "realtime", "tools": [WEATHER], "tool_choice": choice})
            updated = (await collect(conn, lambda e: e.type == "session.updated", DEADLINE_S))[-1]
            assert updated.session.tool_choice is not None
            await ask(conn, "Hi.")
            await collect(conn, is_done, DEADLINE_S)
        # turn detection off restarts the session's input: the tools stay declared
        await conn.session.update(session={"type": "realtime", "audio": {"input": {"turn_detection": None}}})
        await collect(conn, lambda e: e.type == "session.updated", DEADLINE_S)
        await ask(conn, "Hi again.")
        await collect(conn, is_done, DEADLINE_S)
    assert [r.tool_choice for r in llm.requests] == ["required", "get_weather", "auto", "auto", "auto"]
    assert [len(r.tools) for r in llm.requests] == [1, 1, 0, 1, 1]


async def test_server_tools_are_not_shown_as_function_calls():
    """A server tool's call and result feed the reply inside one response."""
    llm = FakeLlm([LlmReply.of("Sure. ", call("calculate", expression="6*7")), LlmReply.of("It is 42.")])
    cfg = config(builtin=("calculator",))
    async with fake_server(cfg, fake_engines(llm=llm, tools=open_tools(cfg))) as srv, \
            connect(srv.port, "ga") as conn:
        await conn.session.update(session={"type": "realtime", "tools": [WEATHER]})
        await ask(conn, "Six times seven?")
        events = await collect(conn, is_done, DEADLINE_S)
    assert not [e for e in events if "function_call" in e.type]
    assert types(events).count("response.created") == 1
    [item] = events[-1].response.output
    assert item.type == "message" and item.content[0].transcript == "Sure. It is 42."
    assert [t.name for t in events[[e.type for e in events].index("session.updated")].session.tools] == [
        "get_weather"]  # the server's own tools are not reported
