"""``--llm openai:URL``: voxpipe's LLM is a real OpenAI-compatible server on loopback.

``transformers serve`` (transformers' own OpenAI-compatible server) runs SmolLM2 from the
local model cache (offline); a recording TCP relay (tests/relay.py) sits between voxpipe
and it, to see the requests, see voxpipe close a stream mid-reply, and play a dead or a
stalled server. One remote server and one voxpipe server for the module.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from audio.pcm import resample
from audio.wav import read_mono
from pipeline.llm.counting import estimate_text, estimate_tokens, template_counter
from pipeline.llm.types import RemoteLlmSpec
from tests.conftest import ROOT, free_port, running_server, stop_process, wait_ready
from tests.relay import Relay
from tests.test_barge_in import LONG, stream_realtime  # LONG: a story, 384 tokens (SmolLM2, greedy)
from tests.test_degrade_server import metric, scrape, transitions
from tests.test_e2e import clip16k, pcm16
from tests.wsclient import MODEL_DEADLINE_S, Client

TIMEOUT_S = 6  # --llm-timeout-s of the module's voxpipe: how long a stalled server is waited for
PACE_S = 0.25
"""The relay's pace for the barge-in test (s per read from the server): the server's reply
then lasts long enough to be cut, however fast the server is."""


# ---- no server ---------------------------------------------------------------------------


@pytest.mark.parametrize("text, base, model", [
    ("openai:http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1", None),
    ("openai:https://llm.example/v1/#org/Model-1B", "https://llm.example/v1", "org/Model-1B"),
    ("openai:http://[::1]:9/v1#m", "http://[::1]:9/v1", "m"),
])
def test_spec_parses(text, base, model):
    assert RemoteLlmSpec.parse(text) == RemoteLlmSpec(base_url=base, model=model)


@pytest.mark.parametrize("text, words", [
    ("openai:127.0.0.1:8000/v1", "http"),
    ("openai:ftp://host/v1", "http"),
    ("openai:http:///v1", "host"),
    ("openai:http://host:99999/v1", "(?i)port"),
    ("openai:http://host/v1?x=1", "query"),
    ("openai:http://host/v1#", "empty model"),
])
def test_bad_spec_is_refused_with_a_reason(text, words):
    with pytest.raises(ValueError, match=words):
        RemoteLlmSpec.parse(text)


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", "serve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_cli_bad_url_is_one_line_exit_2():
    r = _serve("--llm", "openai:localhost:8000/v1")
    assert r.returncode == 2
    assert r.stderr.strip().startswith("voxpipe: bad configuration: --llm") and len(r.stderr.strip().splitlines()) == 1


def test_cli_unreachable_server_is_one_line_exit_2():
    r = _serve("--llm", f"openai:http://127.0.0.1:{free_port()}/v1", "--port", str(free_port()))
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("voxpipe: cannot use the LLM server at http://127.0.0.1:") and "refused" in last
    assert "Traceback" not in r.stderr


def test_a_model_the_server_has_not_is_refused_at_start_up():
    """``openai:URL#nope`` against a server that lists other models and answers 404 for it
    used to fail the warm-up with a traceback: now :meth:`OpenAiLlm.connect` says so
    (``RemoteLlmUnavailable``: one line, exit 2); an unlisted name the server does answer is
    kept (Ollama's aliases)."""
    import http.server
    import json
    import threading

    from pipeline.llm.remote import OpenAiLlm
    from pipeline.llm.types import RemoteLlmUnavailable

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send(200, {"object": "list", "data": [{"id": "m:latest", "object": "model", "created": 0,
                                                         "owned_by": "x"}]})

        def do_POST(self):
            model = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["model"]
            if model.startswith("m"):
                self._send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": model, "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}]})
            else:
                self._send(404, {"error": {"message": f"model {model} not found", "type": "invalid_request_error"}})

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    try:
        with pytest.raises(RemoteLlmUnavailable) as err:
            OpenAiLlm(RemoteLlmSpec(base, "nope"), estimate_tokens, slots=1, queue_size=1).connect()
        assert "has no model 'nope'" in str(err.value) and "m:latest" in str(err.value)
        assert OpenAiLlm(RemoteLlmSpec(base, "m"), estimate_tokens, slots=1, queue_size=1).connect() == "m"
        assert OpenAiLlm(RemoteLlmSpec(base, None), estimate_tokens, slots=1, queue_size=1).connect() == "m:latest"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_estimate_counts_messages_and_errs_high_on_text():
    msgs = [{"role": "system", "content": "x" * 35}, {"role": "user", "content": "y" * 7}]
    assert estimate_tokens(msgs) == 14 + 6 + 3 + 6 + 4
    assert estimate_tokens([]) == 4
    assert estimate_text("AB 12.") == 1 + 1 + 3 and estimate_text("é") == 1 + 1  # ceil(2/2.5), "AB", "1", "2", "."


# ---- a real remote server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_folder() -> Path:
    from pipeline.llm.loader import llm_folder

    return llm_folder("smollm2")


@pytest.mark.slow
def test_estimate_is_above_the_real_count(smollm2_folder, audio_dir, manifest):
    """On real text (the test clips' transcripts, as user turns of a conversation), the
    estimate is at least SmolLM2's own chat-template count."""
    from pipeline.llm.loader import load_tokenizer

    exact = template_counter(load_tokenizer(str(smollm2_folder)))
    texts = [row["reference_transcript"] for row in manifest.values() if row.get("reference_transcript")]
    assert len(texts) >= 5
    texts += ["The meeting is at 10:30 on 2024-05-17; call +1 555 0134.", "Füße, naïve café — «quoted» 東京 😀",
              "def f(x): return x**2 + 3*x - 7", "Das ist ein sehr langes Wort: Donaudampfschifffahrtsgesellschaft."]
    msgs = [{"role": "system", "content": "You are a helpful voice assistant."}]
    for t in texts:
        msgs.append({"role": "user", "content": t})
        assert estimate_tokens(msgs) >= exact(msgs), t
        alone = [msgs[0], {"role": "user", "content": t}]  # voxpipe always sends a system prompt
        assert estimate_tokens(alone) >= exact(alone), t
        msgs.append({"role": "assistant", "content": t.lower()})


@pytest.fixture(scope="module")
def remote(tmp_path_factory, smollm2_folder):
    """``transformers serve`` with SmolLM2 on a free port, offline; yields its port."""
    port = free_port()
    log = tmp_path_factory.mktemp("remote") / "transformers-serve.log"
    exe = Path(sys.executable).parent / "transformers"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(exe), "serve", "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                                 "--dtype", "float32", str(smollm2_folder)], env=env, stdout=fh,
                                stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, f"http://127.0.0.1:{port}/v1/models", log, 300, "transformers serve")
        yield port
    finally:
        stop_process(proc, 30)


@pytest.fixture(scope="module")
def relay(remote):
    r = Relay(remote)
    yield r
    r.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory, relay, smollm2_folder):
    """voxpipe with ``--llm openai:`` (the first model the server lists) behind the relay.
    Lenient SLO and LLM slow-call threshold (a loaded 2-core machine): only failures open
    the LLM breaker here."""
    log = tmp_path_factory.mktemp("voxpipe") / "serve.log"
    with running_server(log, "--llm", f"openai:http://127.0.0.1:{relay.port}/v1", "--fallback-llm", "none",
                        "--slo-ms", "60000", "--breaker-slow-ms", "llm=600000", "--llm-timeout-s", str(TIMEOUT_S),
                        "--max-new-tokens", "384") as (port, proc):
        yield {"url": f"ws://127.0.0.1:{port}/ws", "http": f"http://127.0.0.1:{port}", "log": log,
               "model": str(smollm2_folder)}


async def typed_turn(c: Client, text: str, deadline_s: float = MODEL_DEADLINE_S) -> dict:
    """Send a typed turn; its ``response.done``, or the ``error`` it failed with."""
    old = {id(e) for e in c.conv.events}  # by identity: two failed turns may send equal error events
    await c.send_json({"type": "text.input", "text": text})
    return await c.wait_for(lambda e: e["type"] in ("response.done", "error") and id(e) not in old, deadline_s)


@pytest.mark.slow
async def test_a_spoken_turn_is_answered_by_the_remote_server(server, relay, audio_dir):
    assert f"remote LLM: {server['model']}" in server["log"].read_text()  # the first model listed
    before = len(relay.requests)
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        done = await c.turn(pcm16(clip16k(audio_dir, "en_cmu_goforward.wav")))
    assert done["type"] == "response.done" and done["text"].strip(), c.conv.events
    assert done["output_tokens"] > 0 and done["timings_ms"]["llm_ttft"] > 0
    assert len(c.conv.reply_audio(done["response_id"])) > 8000  # spoken
    sent = b"".join(relay.requests[before:]).decode("utf-8", "replace")
    assert "/chat/completions" in sent and "forward" in sent.lower()  # the transcript went to the remote server
    deltas = "".join(e["delta"] for e in c.conv.of("response.text.delta") if e["response_id"] == done["response_id"])
    assert deltas == done["text"]


@pytest.mark.slow
async def test_barge_in_closes_the_remote_stream(server, relay, audio_dir):
    cuts = len(relay.cut)
    relay.pace_s = PACE_S
    try:
        await _talk_over_a_long_reply(server, audio_dir)
    finally:
        relay.pace_s = 0.0
    await _until(lambda: len(relay.cut) > cuts, "voxpipe closing the remote stream mid-reply")


async def _talk_over_a_long_reply(server, audio_dir) -> None:
    x, sr = read_mono(audio_dir / "en_librispeech_1988-24833-0003.wav")
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        await c.ws.send(pcm16(np.zeros(16000, np.float32)))  # some room tone first
        await c.send_json({"type": "text.input", "text": LONG})
        rid = (await c.wait_for("response.started"))["response_id"]
        await c.wait_until(lambda: c.conv.audio.get(rid), what="the reply's first audio")  # the assistant speaks
        await stream_realtime(c, resample(x, sr, 16000))
        await stream_realtime(c, np.zeros(16000, np.float32))
        cancelled = await c.wait_for(lambda e: e["type"] == "response.cancelled" and e["response_id"] == rid)
    assert cancelled["reason"] == "barge_in", cancelled
    assert not any(e["type"] == "response.done" and e["response_id"] == rid for e in c.conv.events)


@pytest.mark.slow
async def test_a_disconnect_closes_the_remote_stream(server, relay):
    cuts = len(relay.cut)
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        await c.send_json({"type": "text.input", "text": LONG})
        await c.wait_for("response.text.delta")  # the remote stream is flowing
    await _until(lambda: len(relay.cut) > cuts, "voxpipe closing the remote stream after the client left")


@pytest.mark.slow
async def test_a_stalled_server_times_out_with_an_error(server, relay):
    relay.kill()  # drop voxpipe's pooled connections: its next request connects anew...
    relay.revive()
    relay.stall = True  # ... and is accepted, never answered
    try:
        async with Client(server["url"]) as c:
            await c.start(sample_rate=16000, output_sample_rate=16000)
            t0 = time.monotonic()
            err = await typed_turn(c, "Hello there.", deadline_s=TIMEOUT_S + 60)
            waited = time.monotonic() - t0
            assert err["type"] == "error" and err["code"] == "reply_failed", c.conv.events
            assert "timed out" in err["message"] and "LLM server" in err["message"]
            assert waited >= TIMEOUT_S * 0.9  # it was the timeout, not a refusal
            await c.wait_for(lambda e: e["type"] == "response.cancelled" and e["reason"] == "error")
    finally:
        relay.kill()
        relay.revive()


@pytest.mark.slow
async def test_a_dead_server_fails_fast_opens_the_llm_breaker_and_a_revived_one_answers(server, relay):
    async with Client(server["url"]) as c:
        await c.start(sample_rate=16000, output_sample_rate=16000)
        # killed mid-reply: the reply fails with an error event, no hang
        await c.send_json({"type": "text.input", "text": LONG})
        await c.wait_for("response.text.delta")
        relay.kill()
        err = await c.wait_for("error", TIMEOUT_S + 60)
        assert err["code"] == "reply_failed" and "LLM server" in err["message"] and "broke off" in err["message"], err
        # gone: every turn fails at once (connection refused); the LLM breaker opens
        failed = [err]
        while len(failed) < 3 or metric(await asyncio.to_thread(scrape, server["http"]), "voxpipe_breaker_state",
                                        stage="llm") != 1:
            assert len(failed) < 12, "a dead LLM server must open the LLM breaker"
            ev = await typed_turn(c, "Are you there?", deadline_s=TIMEOUT_S + 60)
            # refused at once: "cannot connect", not the read timeout's "timed out"
            assert ev["type"] == "error" and ev["code"] == "reply_failed" and "cannot connect" in ev["message"] \
                and "refused" in ev["message"].lower(), ev
            failed.append(ev)
        status = await c.wait_for(lambda e: e["type"] == "server.status"
                                  and any(x["source"] == "breaker" and x["stage"] == "llm" for x in e["conditions"]))
        assert status
        assert ("llm", "closed", "open") in transitions(server["log"].read_text(), "breaker")
        relay.revive()  # the server is back: turns are answered again (shorter while the breaker is open)
        done = await typed_turn(c, "Say hello.")
        assert done["type"] == "response.done" and done["text"].strip(), c.conv.events[-5:]


async def _until(cond, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"{what} did not happen within {deadline_s} s")
        await asyncio.sleep(0.1)


def test_relay_finish_marker_regex():
    """The relay's notion of a finished stream (the barge-in tests rely on it)."""
    from tests.relay import _FINISHED

    assert _FINISHED.search(b'data: {"choices":[{"delta":{},"finish_reason":"stop"}]}')
    assert not _FINISHED.search(b'data: {"choices":[{"delta":{"content":"Hi"},"finish_reason":null}]}')


def test_the_fallback_llm_is_local_smollm2_under_a_remote_main_llm():
    from pipeline.config import LlmConfig, VoxpipeConfig
    from pipeline.engines import fallback_model

    assert fallback_model(VoxpipeConfig(llm=LlmConfig(model="openai:http://127.0.0.1:8000/v1#smollm2"))) == "smollm2"
    # auto: the next smaller packaged model
    assert fallback_model(VoxpipeConfig(llm=LlmConfig(model="qwen1.5b"))) == "qwen"
    assert fallback_model(VoxpipeConfig(llm=LlmConfig(model="qwen"))) == "smollm2"
    assert fallback_model(VoxpipeConfig(llm=LlmConfig(model="smollm2"))) is None


async def test_slots_queue_busy_and_abort_on_a_stalled_server():
    """Against a server that accepts and never answers (the relay stalling): ``slots``
    requests go out, ``queue_size`` wait, the next is ``Busy``; abort ends each stream at once
    (also one still waiting) and closes its connection; the breaker hears of none of them."""
    from pipeline.errors import Busy
    from pipeline.llm.remote import OpenAiLlm
    from pipeline.llm.types import FinishReason, GenRequest

    class Guard:
        calls: list[tuple[float, bool]] = []

        def permit(self) -> bool:
            return True

        def record(self, duration_s: float, failed: bool) -> None:
            self.calls.append((duration_s, failed))

    relay = Relay(free_port())  # upstream unused: it stalls
    relay.stall = True
    llm = OpenAiLlm(RemoteLlmSpec(f"http://127.0.0.1:{relay.port}/v1", "m"), estimate_tokens, slots=1, queue_size=1,
                    timeout_s=60)
    llm.guard = guard = Guard()
    llm.start()
    try:
        req = GenRequest(messages=[{"role": "user", "content": "Hi"}], max_new_tokens=8)
        sent = llm.submit(req)
        await _until(lambda: (llm.load().active, llm.load().depth) == (1, 0) and len(relay.requests) >= 1,
                     "one request sent")
        queued = llm.submit(req)
        assert llm.load().depth == 1
        with pytest.raises(Busy):
            llm.submit(req)
        for stream in (queued, sent):
            stream.abort()
            assert [d async for d in stream] == [] and stream.stats.finish_reason is FinishReason.ABORT
        await _until(lambda: (llm.load().active, llm.load().depth) == (0, 0) and len(relay.cut) == 1,
                     "the stream closed")
        assert guard.calls == []
    finally:
        llm.stop()
        relay.kill()
