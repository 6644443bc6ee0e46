"""Tools with the real default model (Qwen2.5-Coder-0.5B) on a real server: a spoken request
through ``/ws`` runs a server tool and the reply says so; the official ``openai`` client runs
a whole tool round trip on ``/v1/chat/completions``, streaming and not. The orchestration
alone, over a scripted LLM: tests/test_tools_session.py."""

from __future__ import annotations

import json

import openai
import pytest

from audio.pcm import float_to_pcm16
from tests.conftest import running_server
from tests.spoken import spoken
from tests.wsclient import MODEL_DEADLINE_S, Client

pytestmark = pytest.mark.slow  # a real server with the real default model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def qwen_tools(tmp_path_factory):
    """``voxpipe serve --llm qwen`` with the built-in tools on."""
    log = tmp_path_factory.mktemp("tools") / "serve.log"
    with running_server(log, "--llm", "qwen", "--slo-ms", "60000", "--builtin-tool", "timer",
                        "--builtin-tool", "time", "--builtin-tool", "calculator") as (port, _proc):
        yield {"ws": f"ws://127.0.0.1:{port}/ws", "http": f"http://127.0.0.1:{port}", "log": log}


async def test_a_spoken_timer_request_runs_the_tool_and_is_confirmed_aloud(qwen_tools):
    audio = float_to_pcm16(spoken("Set a timer for five minutes."))
    async with Client(qwen_tools["ws"]) as c:
        await c.start(sample_rate=16000)
        done = await c.turn(audio)
        assert done["type"] == "response.done", done
        [final] = [e for e in c.conv.events if e["type"] == "transcript.final"]
        assert "timer" in final["text"].lower()
        [call] = [e for e in c.conv.events if e["type"] == "tool.call"]
        args = call["arguments"]
        assert call["name"] == "set_timer" and call["runs_on"] == "server"
        assert args.get("minutes", 0) * 60 + args.get("seconds", 0) == 300, args
        [output] = [e for e in c.conv.events if e["type"] == "tool.output"]
        assert output["error"] is None and json.loads(output["output"])["seconds"] == 300
        text = done["text"]
        assert "<tool_call>" not in text and '"name"' not in text and "{" not in text  # words, not markup
        assert any(w in text.lower() for w in ("timer", "five", "5", "minute", "set", "ring")), text
        assert done["audio_s"] > 0.3 and c.conv.reply_audio(done["response_id"]).size > 0


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=MODEL_DEADLINE_S)


async def test_the_openai_client_runs_a_tool_round_trip(qwen_tools):
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    async with client(qwen_tools["http"]) as c:
        first = await c.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER], temperature=0,
                                                max_tokens=60)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather" and "paris" in json.loads(call.function.arguments)["city"].lower()
        # streaming gives the same call, its deltas put together the way the client's docs show
        calls: dict[int, dict] = {}
        finish = None
        async for chunk in await c.chat.completions.create(model="qwen", messages=ask, tools=[WEATHER],
                                                           temperature=0, max_tokens=60, stream=True):
            for part in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                got = calls.setdefault(part.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += part.id or ""
                got["name"] += part.function.name or "" if part.function else ""
                got["arguments"] += part.function.arguments or "" if part.function else ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "tool_calls" and [v["name"] for v in calls.values()] == ["get_weather"]
        assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)
        # the result goes back as a tool message (with a nudge, as voxpipe's own voice turns
        # add one: pipeline/session/tool_turn.py SAY_RESULT): the model answers in words
        follow = [*ask, choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21, "sky": "sunny"}'},
                  {"role": "user", "content": "Tell me that result in one short spoken sentence, in words."}]
        answer = await c.chat.completions.create(model="qwen", messages=follow, tools=[WEATHER],
                                                 temperature=0, max_tokens=60)
        text = answer.choices[0].message.content or ""
        assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
        assert "21" in text or "sunny" in text.lower(), text
