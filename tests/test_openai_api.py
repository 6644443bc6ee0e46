"""The OpenAI-compatible HTTP API (server/openai_api.py behind server/http_front.py), driven
by the official ``openai`` client against a real server on loopback.

Real SmolLM2 (``slow``): ``voxpipe serve`` in a subprocess (the session ``server`` fixture)
for the main paths and a voice session sharing the batch; an in-process server over the real
LLM engine for the disconnect (the engine's counters are read directly). Fake engines
(tests/fake_server.py) for the policies: validation, busy, the token, the sniffing front.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path

import httpx2
import openai
import pytest
from websockets.asyncio.client import connect

from pipeline.config import AdmissionConfig, LlmConfig, ServerConfig, VoxpipeConfig
from pipeline.engines import load_stage
from pipeline.errors import Busy
from pipeline.llm.types import PRIORITY_TEXT
from server.openai_api import model_id
from tests.fake_server import Running, fake_server
from tests.fakes import FakeLlm, LlmReply, fake_engines
from tests.wsclient import MODEL_DEADLINE_S, Client

DEADLINE_S = 60.0
TOKEN = "s3cret-token"
HELLO = [{"role": "user", "content": "Say hello."}]
MODEL = model_id(LlmConfig().model)  # what a fake server serves: the default model's name


def nested(depth: int) -> dict:
    """An object schema ``depth`` levels deep."""
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = nested(100)


def client(base: str, api_key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0, timeout=MODEL_DEADLINE_S)


async def raw(port: int, data: bytes, *, close_after_write: bool = False) -> bytes:
    """Send raw bytes to the server; everything it answers until it closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if close_after_write:
            writer.write_eof()
        async with asyncio.timeout(DEADLINE_S):
            return await reader.read()
    finally:
        writer.close()


def post(body: bytes | dict, **headers: str) -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": "127.0.0.1", "Content-Type": "application/json",
                                                  "Content-Length": str(len(data)), "Connection": "close",
                                                  **headers}.items())
    return f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode() + data


async def until_true(cond, what: str, deadline_s: float = DEADLINE_S) -> None:
    """Poll ``cond`` until it holds; fail (TimeoutError) after ``deadline_s``."""
    async with asyncio.timeout(deadline_s):
        while True:
            if cond():
                return
            await asyncio.sleep(0.02)


# ---- the policies, over fake engines ---------------------------------------------------


async def test_models_and_a_completion_over_fakes():
    llm = FakeLlm(default=LlmReply.of("Hel", "lo", "!"))
    async with fake_server(engines=fake_engines(llm=llm)) as srv:
        async with client(srv.http) as c:
            models = await c.models.list()
            assert [(m.id, m.owned_by) for m in models.data] == [(MODEL, "voxpipe")]
            assert (await c.models.retrieve(MODEL)).id == MODEL
            r = await c.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0.5,
                                                top_p=0.9, seed=7, stop=["\n"], user="someone")  # user: ignored
            assert r.object == "chat.completion" and r.choices[0].message.content == "Hello!"
            assert r.choices[0].finish_reason == "stop"
            assert r.usage is not None and r.usage.completion_tokens == 3
            assert r.usage.total_tokens == r.usage.prompt_tokens + 3
            req = llm.requests[-1]
            assert (req.max_new_tokens, req.temperature, req.top_p, req.seed, req.stop) == (5, 0.5, 0.9, 7, ["\n"])
            assert req.messages == [{"role": "user", "content": "Say hello."}]
            assert req.priority == PRIORITY_TEXT  # voice turns take free batch slots first
            chunks = [ch async for ch in await c.chat.completions.create(
                model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True})]
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "Hello!"
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
            assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3


async def test_text_parts_developer_role_and_max_tokens_capped():
    llm = FakeLlm()
    cfg = VoxpipeConfig(llm=LlmConfig(max_new_tokens=20))
    async with fake_server(cfg, fake_engines(llm=llm)) as srv, client(srv.http) as c:
        await c.chat.completions.create(model=MODEL, max_completion_tokens=500, messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}])
        assert llm.requests[-1].messages == [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "one\ntwo"}]
        assert llm.requests[-1].max_new_tokens == 20  # the server's --max-new-tokens caps the client's


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "function", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, "messages.0"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "messages.0"),  # no tool_call_id
    ({"model": MODEL, "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"model": MODEL, "messages": HELLO, "n": 2}, "n"),
    ({"model": MODEL, "messages": HELLO, "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": HELLO, "top_p": 0}, "top_p"),
    ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": HELLO, "seed": 2**70, "temperature": 0.5}, "seed"),  # torch's seed overflows:
    # it failed the engine step, and with it every reply in the batch (voice sessions too)
    ({"model": MODEL, "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL, "messages": HELLO, "logprobs": True}, "logprobs"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]}, "tools"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools.0.function.name"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"model": MODEL, "messages": HELLO, "tool_choice": "required"}, "tool_choice"),
    ({"model": MODEL, "messages": HELLO, "tools": [{"type": "function", "function": {  # 100 levels: was a 500
        "name": "f", "parameters": DEEP}}]}, "tools"),
    ({"model": MODEL, "messages": [*HELLO, {"role": "tool", "tool_call_id": "call_x", "content": "42"}]},
     "messages"),  # answers no call
])
async def test_invalid_requests_get_400_with_an_openai_error(body, param):
    llm = FakeLlm()
    async with fake_server(engines=fake_engines(llm=llm)) as srv, client(srv.http) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(**body)
        err = info.value.body
        assert isinstance(err, dict) and err["type"] == "invalid_request_error" and err["param"] == param
        assert err["message"] and llm.requests == []  # refused before any work


async def test_bad_json_unknown_model_unknown_path_and_method():
    async with fake_server() as srv:
        for body in (b"{not json", b"[1]", json.dumps({"messages": HELLO}).encode(),
                     b'{"model": "qwen", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # RecursionError: 500
                     b'{"model": "qwen", "messages": [{"role": "user", "content": "\\ud800"}]}',  # lone surrogate: 500
                     b'{"model": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}'):
            answer = await raw(srv.port, post(body))
            assert b" 400 " in answer.split(b"\r\n", 1)[0]
            assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "invalid_request_error"
        async with client(srv.http) as c:
            with pytest.raises(openai.NotFoundError) as info:
                await c.chat.completions.create(model="gpt-4o", messages=HELLO)
            assert info.value.code == "model_not_found"
        async with httpx2.AsyncClient(base_url=srv.http) as h:
            r = await h.get("/v1/embeddings")
            assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
            r = await h.get("/v1/chat/completions")
            assert r.status_code == 405 and "error" in r.json()
            for path in ("/elsewhere", "/healthz", "/v1/realtime"):  # websockets' parser: GET only; a POST
                r = await h.post(path, content=b"x")  # with a body got no answer at all (an empty reply)
                assert r.status_code == 405, path


async def test_context_too_long_is_400_context_length_exceeded():
    cfg = VoxpipeConfig(llm=LlmConfig(max_context_tokens=64, max_new_tokens=16))
    llm = FakeLlm()  # counts a word as a token
    async with fake_server(cfg, fake_engines(llm=llm)) as srv, client(srv.http) as c:
        with pytest.raises(openai.BadRequestError) as info:
            await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 100}])
        assert info.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError):  # fits, but not with the completion asked for
            await c.chat.completions.create(model=MODEL, max_tokens=16,
                                            messages=[{"role": "user", "content": "word " * 50}])
        await c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 50}])
        assert llm.requests[-1].max_new_tokens == 64 - 54  # what is left of the context


async def test_busy_server_answers_503_with_retry_after_before_any_work():
    llm = FakeLlm()
    llm.depth = 40  # 40 requests queued for the batch: a reply now would miss the SLO
    cfg = VoxpipeConfig(admission=AdmissionConfig(slo_ms=500.0))
    async with fake_server(cfg, fake_engines(llm=llm)) as srv, client(srv.http) as c:
        with pytest.raises(openai.InternalServerError) as info:
            await c.chat.completions.create(model=MODEL, messages=HELLO)
        resp = info.value.response
        assert resp.status_code == 503 and int(resp.headers["Retry-After"]) >= 1
        assert info.value.code == "queue" and llm.requests == []
        metrics = (await raw(srv.port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                   ).decode()
        assert re.search(r'voxpipe_http_api_requests_total\{endpoint="chat_completions",status="503"\} [1-9]',
                         metrics)
        assert re.search(r'voxpipe_admissions_total\{decision="refused",reason="queue"\} [1-9]', metrics)


async def test_http_connections_over_the_cap_get_503_and_the_cap_frees_up(caplog):
    """Keep-alive connections count until closed: with a cap of 2, a third is answered 503
    (Retry-After, an OpenAI error) and closed at once, without an error in the log; voice
    sessions are not affected."""
    get_models = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    caplog.set_level(logging.ERROR)
    async with fake_server(VoxpipeConfig(server=ServerConfig(max_sessions=2))) as srv:
        held = []
        for _ in range(2):  # two clients that keep their connections open
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(get_models)
            assert (await asyncio.wait_for(reader.readline(), DEADLINE_S)).startswith(b"HTTP/1.1 200")
            held.append(writer)
        answer = await raw(srv.port, post({"model": MODEL, "messages": HELLO}, Connection="keep-alive"))
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 5" in head, answer
        assert json.loads(body)["error"]["code"] == "server_full"
        scraped = (await raw(srv.port, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                   ).decode()
        assert re.search(r'voxpipe_http_api_requests_total\{endpoint="connection_cap",status="503"\} [1-9]', scraped)
        # the refused connection closed quietly (it once reached websockets' connection_lost, a traceback each)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        async with Client(srv.ws) as voice:  # sessions have their own cap
            await voice.start()
        held.pop().close()
        async with client(srv.http) as c:
            front = srv.app.http_front
            assert front is not None
            await until_true(lambda: len(front.state.connections) < 2, "a connection to close")
            r = await c.chat.completions.create(model=MODEL, messages=HELLO)
            assert r.choices[0].message.content
        for w in held:
            w.close()


async def test_engine_queue_full_is_503():
    llm = FakeLlm([Busy("llm is busy: 64 requests already queued")])
    async with fake_server(engines=fake_engines(llm=llm)) as srv, client(srv.http) as c:
        with pytest.raises(openai.InternalServerError) as info:
            await c.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
        assert info.value.response.status_code == 503 and info.value.code == "stage"
        assert "Retry-After" in info.value.response.headers
        r = await c.chat.completions.create(model=MODEL, messages=HELLO)  # the next one is served
        assert r.choices[0].message.content == "Okay."


async def test_open_llm_breaker_and_warm_up_are_503():
    llm = FakeLlm()
    async with fake_server(engines=fake_engines(llm=llm)) as srv, client(srv.http) as c:
        guard = srv.app.governor.guards["llm"]
        guard.breaker.force_open(time.monotonic())
        with pytest.raises(openai.InternalServerError) as info:
            await c.chat.completions.create(model=MODEL, messages=HELLO)
        assert info.value.code == "breaker" and int(info.value.response.headers["Retry-After"]) >= 1
        guard.breaker.reset(time.monotonic())
        srv.app.ready = False
        with pytest.raises(openai.InternalServerError) as info:
            await c.chat.completions.create(model=MODEL, messages=HELLO)
        assert info.value.code == "not_ready" and llm.requests == []
        srv.app.ready = True
        assert (await c.chat.completions.create(model=MODEL, messages=HELLO)).choices[0].message.content


async def test_the_token_is_needed_and_is_the_api_key():
    cfg = VoxpipeConfig(server=ServerConfig(token=TOKEN))
    async with fake_server(cfg) as srv:
        async with client(srv.http, api_key="wrong") as c:
            with pytest.raises(openai.AuthenticationError) as info:
                await c.models.list()
            assert info.value.response.headers["WWW-Authenticate"].startswith("Bearer")
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model=MODEL, messages=HELLO)
        async with client(srv.http, api_key=TOKEN) as c:
            assert (await c.chat.completions.create(model=MODEL, messages=HELLO)).choices[0].message.content


async def test_other_sites_pages_and_hosts_are_refused():
    async with fake_server() as srv, httpx2.AsyncClient(base_url=srv.http) as h:
        r = await h.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO},
                         headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin"
        r = await h.get("/v1/models", headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host"


async def test_disconnect_mid_stream_aborts_the_generation():
    llm = FakeLlm(default=LlmReply.of(*["word "] * 200, delay_s=0.05))
    async with fake_server(engines=fake_engines(llm=llm)) as srv:
        async with client(srv.http) as c:
            stream = await c.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
            n = 0
            async for _ in stream:
                n += 1
                if n == 3:
                    break
            await stream.close()
        await until_true(lambda: llm.streams and llm.streams[0].aborted, "the stream aborted")
        assert llm.streams[0].stats.output_tokens < 200


async def test_server_close_ends_open_http_connections():
    llm = FakeLlm(default=LlmReply.of(*["word "] * 1000, delay_s=0.05))
    async with fake_server(engines=fake_engines(llm=llm)) as srv:
        c = client(srv.http)
        await c.models.list()  # a kept-alive idle connection
        stream = await c.chat.completions.create(model=MODEL, messages=HELLO, stream=True)
        await anext(aiter(stream))
        idle = await asyncio.open_connection("127.0.0.1", srv.port)  # connected, nothing sent yet
    # the block closed the server: the stream in progress is cut and its generation aborted
    assert llm.streams[0].aborted
    with pytest.raises((openai.APIError, httpx2.HTTPError)):
        async with asyncio.timeout(DEADLINE_S):
            async for _ in stream:
                pass
    async with asyncio.timeout(DEADLINE_S):
        assert await idle[0].read() == b""
    idle[1].close()
    await c.close()


# ---- the sniffing front: everything else is as before -------------------------------------


async def test_ws_web_page_and_health_still_served():
    async with fake_server() as srv:
        async with connect(srv.ws) as ws:
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
            assert json.loads(await ws.recv())["type"] == "session.started"
            await ws.send(json.dumps({"type": "text.input", "text": "hi"}))
            async with asyncio.timeout(DEADLINE_S):
                while not (isinstance(m := await ws.recv(), str) and json.loads(m)["type"] == "response.done"):
                    pass
        async with httpx2.AsyncClient(base_url=srv.http) as h:
            page = await h.get("/")
            assert page.status_code == 200 and "<html" in page.text.lower()
            assert (await h.get("/healthz")).text == "ready\n"
            # the API's kept-alive connection answers a later plain request as websockets would
            assert (await h.get("/v1/models")).status_code == 200
            assert (await h.get("/healthz")).text == "ready\n"
            assert (await h.get("/no-such-file")).status_code == 404


async def test_garbage_huge_headers_and_early_close_leave_the_server_working():
    async with fake_server() as srv:
        # not a request line: websockets drops it as it always did (no answer); a bad head on an
        # API request: uvicorn's 400
        for garbage in (b"\x16\x03\x01garbage\r\n\r\n", b"POST /v1/chat/completions HTP\r\n\r\n"):
            assert not (await raw(srv.port, garbage)).startswith(b"HTTP/1.1 2")
        bad_head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nno colon here\r\n\r\n"
        assert b" 400 " in (await raw(srv.port, bad_head)).split(b"\r\n", 1)[0]
        big = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nX-Big: " + b"a" * 20_000
        big += b"\r\n\r\n"
        assert b" 431 " in (await raw(srv.port, big)).split(b"\r\n", 1)[0]
        endless = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 64 * 1024  # no end of head
        assert b" 400 " in (await raw(srv.port, endless)).split(b"\r\n", 1)[0]
        long_line = b"GET /" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"  # websockets refuses it
        assert (await raw(srv.port, long_line)).startswith(b"HTTP/1.1 4")
        # closed mid-line, mid-head and mid-body
        for part in (b"POST /v1/chat", b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127",
                     post({"model": MODEL, "messages": HELLO})[:-10]):
            await raw(srv.port, part, close_after_write=True)
        async with client(srv.http) as c:
            assert (await c.chat.completions.create(model=MODEL, messages=HELLO)).choices[0].message.content
        assert srv.app.sessions == 0


# ---- real SmolLM2 ---------------------------------------------------------------------------


async def test_slow_heads_and_short_bodies_hold_no_connection(monkeypatch):
    """Slowloris: a request head sent one header line at a time, forever, is cut off after
    the head timeout (no progress on a head for a whole check period); a body that stops
    short of its Content-Length gets 408. Both timeouts shrunk to 1 s for the test."""
    import server.http_front as front
    import server.openai_api as api

    monkeypatch.setattr(front, "REQUEST_HEAD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(api, "BODY_TIMEOUT_S", 1.0)
    async with fake_server() as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for i in range(60):  # a header line every 0.25 s: 15 s if never cut
            try:
                writer.write(f"X-Slow-{i}: {i}\r\n".encode())
                await writer.drain()
            except (ConnectionError, OSError):
                closed = True
                break
            try:
                if await asyncio.wait_for(reader.read(1), 0.25) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        writer.close()
        assert closed, "a head trickling in for 15 s was never cut off"
        head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n")
        answer = await asyncio.wait_for(raw(srv.port, head + b'{"model": "x", "mes'), DEADLINE_S)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"request_timeout" in answer
        async with client(srv.http) as c:  # the server goes on
            assert (await c.models.list()).data


def _batched_steps(metrics_text: str) -> float:
    """LLM steps that ran more than one request (from the batch-size histogram)."""
    count = float(re.search(r"^voxpipe_llm_batch_size_count (\S+)$", metrics_text, re.M).group(1))
    ones = float(re.search(r'^voxpipe_llm_batch_size_bucket\{le="1\.0"\} (\S+)$', metrics_text, re.M).group(1))
    return count - ones


@pytest.mark.slow
async def test_real_model_list_complete_and_stream_agree(server):
    async with client(server["http"]) as c:
        assert [m.id for m in (await c.models.list()).data] == ["smollm2"]
        ask = [{"role": "user", "content": "Name three colors."}]
        # Both requests below reuse this one's cached prompt blocks, so they compute alike. (A cold
        # prompt and a cached one round differently: an ulp in bf16, which int8 activations can turn
        # into another greedy token at a near-tie; docs/ARCHITECTURE.md, "Greedy replies and rounding".)
        await c.chat.completions.create(model="smollm2", messages=ask, max_tokens=1, temperature=0)
        whole = await c.chat.completions.create(model="smollm2", messages=ask, max_tokens=24, temperature=0)
        text = whole.choices[0].message.content
        assert text and text.strip()
        u = whole.usage
        assert u is not None and u.prompt_tokens > 5 and 0 < u.completion_tokens <= 24
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert whole.choices[0].finish_reason == ("length" if u.completion_tokens == 24 else "stop")
        chunks = [ch async for ch in await c.chat.completions.create(
            model="smollm2", messages=ask, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True})]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == u.completion_tokens


@pytest.mark.slow
async def test_real_voice_session_and_http_client_share_the_batch(server, audio_dir):
    async with httpx2.AsyncClient(base_url=server["http"], timeout=MODEL_DEADLINE_S) as h:
        before = _batched_steps((await h.get("/metrics")).text)
    async with client(server["http"]) as c, Client(server["url"]) as voice:
        await voice.start(sample_rate=16000)
        stream = await c.chat.completions.create(
            model="smollm2", stream=True, max_tokens=96, temperature=0,
            messages=[{"role": "user", "content": "Count from 1 to 100, separated by commas."}])
        it = aiter(stream)
        first = await anext(it)
        assert first.choices[0].delta.role == "assistant"
        await voice.send_json({"type": "text.input", "text": "What is the capital of France?"})
        started = await voice.wait_for("response.started")
        t_started = time.monotonic()
        http_text, last_chunk = "", 0.0
        async for ch in it:
            if ch.choices and ch.choices[0].delta.content:
                http_text += ch.choices[0].delta.content
                last_chunk = time.monotonic()
        done = await voice.wait_for(lambda e: e["type"] == "response.done"
                                    and e["response_id"] == started["response_id"])
    assert "paris" in done["text"].lower() and len(http_text.split(",")) > 5
    assert last_chunk > t_started  # the HTTP reply was still generating when the voice reply was submitted
    async with httpx2.AsyncClient(base_url=server["http"], timeout=MODEL_DEADLINE_S) as h:
        assert _batched_steps((await h.get("/metrics")).text) > before  # both ran in one batch


@pytest.fixture(scope="module")
async def real_llm_server():
    """An in-process server over the real SmolLM2 engine (fake ASR/TTS): its engine's counters."""
    cfg = VoxpipeConfig(llm=LlmConfig(model="smollm2", max_new_tokens=96))
    llm = await asyncio.to_thread(load_stage, cfg, "llm")
    llm.start()
    try:
        async with fake_server(cfg, fake_engines(llm=llm)) as srv:  # type: ignore[arg-type]
            yield srv, llm
    finally:
        llm.stop()


@pytest.mark.slow
async def test_real_disconnect_mid_stream_aborts_the_generation(real_llm_server):
    srv, llm = real_llm_server
    assert isinstance(srv, Running)
    steps0 = llm.stats.steps
    async with client(srv.http) as c:
        stream = await c.chat.completions.create(
            model="smollm2", stream=True, max_tokens=96, temperature=0,
            messages=[{"role": "user", "content": "Count from 1 to 100, separated by commas."}])
        n = 0
        async for ch in stream:
            n += bool(ch.choices and ch.choices[0].delta.content)
            if n == 3:
                break
        assert llm.load().active == 1
        await stream.close()
    await until_true(lambda: llm.load().active == 0, "the engine's batch empty", MODEL_DEADLINE_S)
    # aborted, not finished: far fewer steps than the 96 tokens it was allowed
    assert llm.stats.steps - steps0 < 48


def test_model_ids():
    assert model_id("smollm2") == "smollm2"
    assert model_id(str(Path("/models/My-LLM"))) == "My-LLM"
    assert model_id("openai:http://127.0.0.1:8000/v1#Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
