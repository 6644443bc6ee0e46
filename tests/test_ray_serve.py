"""voxpipe's model stages as Ray Serve deployments, on a real local Ray instance (loopback).

1. Back-pressure: Serve's ``BackPressureError`` and a replica's ``Busy`` reach the session
   as :class:`~pipeline.errors.Busy` (scripted deployments, no model); aborting a remote
   reply cancels the replica's generator.
2. A spoken turn end to end through ``voxpipe serve --ray`` (SmolLM2, fp32 greedy): a real
   clip in over a real WebSocket, transcript and reply audio out; the reply equals the
   in-process server's for the same transcript, and a typed turn's reply equals its too.
3. The LLM replica's actor killed mid-reply: that turn gets a typed ``error``, the session
   stays connected, Serve restarts the replica, and the next turn is answered.
4. The front end as Serve's ingress (server/ingress.py, behind Serve's HTTP proxy) over the
   same stages: a typed turn answered over a real WebSocket, the edge checks, and a live
   WebSocket holding one of the ingress's ``max_ongoing_requests`` for its whole life.

Ray is kept small: 2 logical CPUs, no dashboard, worker logs not forwarded.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import replace

import numpy as np
import pytest

if os.environ.get("CI"):
    import ray  # CI installs the ray extra (.ci/setup.sh): a missing Ray is a failure there
else:
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

from ray import serve
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from audio.pcm import resample
from audio.wav import read_mono
from clients.client import ask
from pipeline.config import VoxpipeConfig
from pipeline.errors import Busy
from pipeline.llm.types import GenRequest, GenStats
from pipeline.remote.clients import RemoteLlm, RemoteTts
from pipeline.remote.types import StageUnavailable
from pipeline.tts.types import Speech
from server.ingress import build_ingress_app
from tests.conftest import free_port, running_server
from tests.wsclient import Client, wer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CLIP = "en_librispeech_3752-4944-0000.wav"  # "Captain Frere says that the scenery is delightful", 3.3 s
SERVE_ARGS = ("--device", "cpu-fp32", "--slo-ms", "60000")  # fp32 greedy: the same text in both paths
TYPED = "Captain Frere says that the scenery is delightful."
LONG_ASK = "Tell me a long story about a brave knight, a dragon and a lost city."
RESTART_LIMIT_S = 30.0
HTTP_PORT = free_port()  # Serve's HTTP proxy (the ingress test); the other tests use handles


class ScriptedTts:
    """A TTS stage without a voice: ``run`` takes ``delay_s``; ``busy`` text raises Busy."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def run(self, text: str, priority: int | None = None) -> Speech:
        if text == "breaker":
            raise Busy("tts circuit breaker open", reason="breaker", retry_after_ms=2000)
        await asyncio.sleep(self.delay_s)
        return Speech(audio=np.zeros(10, np.float32), sample_rate=16000, synth_ms=self.delay_s * 1000)


class ScriptedLlm:
    """An LLM stage without a model: ``generate`` streams one word per 50 ms and counts
    the streams cancelled under it."""

    def __init__(self) -> None:
        self.cancelled = 0

    async def generate(self, req: GenRequest):
        try:
            for i in range(req.max_new_tokens):
                await asyncio.sleep(0.05)
                yield f"w{i} "
            yield GenStats(output_tokens=req.max_new_tokens)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def cancelled_count(self) -> int:
        return self.cancelled


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance for this module; yields its GCS address (what ``--ray`` takes)."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # scripted deployments: by value
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        serve.shutdown()
        ray.shutdown()


async def test_backpressure_and_replica_busy_become_busy(ray_cluster):
    tts = serve.deployment(ScriptedTts, name="scripted_tts", max_ongoing_requests=1, max_queued_requests=1,
                           ray_actor_options={"num_cpus": 0})
    handle = serve.run(tts.bind(1.0), name="scripted_tts", route_prefix=None)
    client = RemoteTts(handle)
    calls = []
    for i in range(3):  # one at a time: Serve's router counts a request queued until it is assigned
        calls.append(asyncio.create_task(client.run(f"phrase {i}")))
        await asyncio.sleep(0.3)
    results = await asyncio.gather(*calls, return_exceptions=True)
    busy = [r for r in results if isinstance(r, Busy)]
    assert len(busy) == 1 and busy[0].reason == "stage", results  # 1 running + 1 queued; the third refused
    assert sum(isinstance(r, Speech) for r in results) == 2, results
    with pytest.raises(Busy) as refused:  # a replica's own Busy keeps its reason and retry hint
        await client.run("breaker")
    assert (refused.value.reason, refused.value.retry_after_ms) == ("breaker", 2000)
    serve.delete("scripted_tts")


async def test_llm_refuses_before_the_reply_and_abort_reaches_the_replica(ray_cluster):
    llm = serve.deployment(ScriptedLlm, name="scripted_llm", max_ongoing_requests=1, max_queued_requests=1,
                           ray_actor_options={"num_cpus": 0})
    handle = serve.run(llm.bind(), name="scripted_llm", route_prefix=None)
    client = RemoteLlm(handle, queue_size=64, max_ongoing=1, max_queued=1)
    req = GenRequest(messages=[{"role": "user", "content": "hi"}], max_new_tokens=200)
    first, second = client.submit(req), client.submit(req)
    with pytest.raises(Busy):  # synchronous, as the in-process engine: before response.started
        client.submit(req)
    assert await first.__anext__() == "w0 "
    first.abort()
    second.abort()
    assert client.in_flight == 0
    for _ in range(300):  # 30 s at most
        if await handle.cancelled_count.remote() >= 1:
            break
        await asyncio.sleep(0.1)
    assert await handle.cancelled_count.remote() >= 1  # CancelledError reached the replica's generator
    # back-pressure after the reply started (another caller filled the queue): a typed failure
    blind = RemoteLlm(handle, queue_size=64)  # no capacity known: nothing refused up front
    streams, firsts = [], []
    for _ in range(3):
        streams.append(blind.submit(req))
        firsts.append(asyncio.create_task(streams[-1].__anext__()))
        await asyncio.sleep(0.3)
    outcomes = await asyncio.gather(*firsts, return_exceptions=True)
    assert sum(isinstance(o, StageUnavailable) for o in outcomes) == 1, outcomes
    for s in streams:
        s.abort()
    serve.delete("scripted_llm")


def clip_pcm16(audio_dir) -> bytes:
    x, sr = read_mono(audio_dir / CLIP)
    return (np.clip(resample(x, sr, 16000), -1, 1) * 32767).astype("<i2").tobytes()


async def typed_reply(url: str, text: str) -> str:
    """The reply to one typed turn in a fresh session (no ASR: the same prompt on any path)."""
    async with Client(url) as c:
        await c.start(sample_rate=16000, format="pcm16", channels=1, output_sample_rate=16000)
        await c.send_json({"type": "text.input", "text": text})
        done = await c.wait_for("response.done")
        return done["text"]


async def both_turns(url: str, audio_dir) -> tuple:
    """(the clip spoken in real time: AskResult, the reply to its reference text typed)."""
    spoken = await ask(str(audio_dir / CLIP), url=url, timeout_s=300)
    return spoken, await typed_reply(url, TYPED)


@pytest.fixture(scope="module")
def in_process_turns(tmp_path_factory, audio_dir):
    """:func:`both_turns` through the in-process server (fp32), stopped afterwards."""
    log = tmp_path_factory.mktemp("inproc") / "serve.log"
    with running_server(log, *SERVE_ARGS) as (port, _):
        return asyncio.run(both_turns(f"ws://127.0.0.1:{port}/ws", audio_dir))


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    """``voxpipe serve --ray <this module's cluster>`` (fp32): its URL and log."""
    log = tmp_path_factory.mktemp("ray") / "serve.log"
    t0 = time.monotonic()
    with running_server(log, "--ray", ray_cluster, *SERVE_ARGS) as (port, _):
        print(f"\n--ray front end ready in {time.monotonic() - t0:.1f} s (Serve deploy + warm-up)")
        yield {"url": f"ws://127.0.0.1:{port}/ws", "log": log}


async def test_spoken_turn_through_serve_matches_in_process(in_process_turns, ray_server, audio_dir, manifest):
    here, here_typed = in_process_turns
    there, there_typed = await both_turns(ray_server["url"], audio_dir)
    assert not there.errors and not here.errors, (there.errors, here.errors)
    assert there_typed.strip() and there_typed == here_typed  # same prompt, fp32 greedy: the same reply
    assert wer(manifest[CLIP]["reference_transcript"], there.transcript) <= 0.2, there.transcript
    assert there.reply_text.strip() and there.reply_audio_s >= 0.5
    # streaming ASR commits words as decodes and audio race: the same clip may (rarely) be heard
    # differently by two runs; the same transcript must then get the same reply
    if there.transcript == here.transcript:
        assert there.reply_text == here.reply_text
    else:
        print(f"\ntranscripts differ (in-process {here.transcript!r}, Serve {there.transcript!r})")
    print("\n| path | transcript | voice-to-voice ms | LLM TTFT ms | first audio ms |\n|---|---|---|---|---|")
    for name, r in (("in-process", here), ("Ray Serve", there)):
        t = r.timings_ms
        print(f"| {name} | {r.transcript} | {t.get('voice_to_voice')} | {t.get('llm_ttft')} | {t.get('first_audio')} |")


def llm_replicas() -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::voxpipe#llm#"))


def llm_running() -> bool:
    dep = serve.status().applications["voxpipe"].deployments["llm"]
    return str(dep.status).endswith("HEALTHY") and dep.replica_states.get("RUNNING", 0) >= 1


async def test_killed_llm_replica_costs_only_that_turn(ray_server, audio_dir):
    async with Client(ray_server["url"]) as c:
        await c.start(sample_rate=16000, format="pcm16", channels=1, output_sample_rate=16000)
        (victim,) = llm_replicas()
        await c.send_json({"type": "text.input", "text": LONG_ASK})
        await c.wait_for("response.text.delta")
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        t_kill = time.monotonic()
        err = await c.wait_for("error")
        assert err["code"] == "reply_failed" and not err["fatal"], err
        cancelled = await c.wait_for("response.cancelled")
        assert cancelled["reason"] == "error", cancelled
        assert not c.conv.of("response.done")  # the killed turn did not pretend to finish
        while not (llm_running() and llm_replicas() and llm_replicas() != [victim]):
            assert time.monotonic() - t_kill < 120, serve.status()
            await asyncio.sleep(0.25)
        restart_s = time.monotonic() - t_kill
        print(f"\nLLM replica back (HEALTHY, model loaded and warmed up) {restart_s:.1f} s after the kill")
        done = await c.turn(clip_pcm16(audio_dir))  # the same connection: the next turn is answered
        assert done["type"] == "response.done" and done["text"].strip(), c.conv.events[-5:]
        assert not c.ws.close_code
    assert restart_s < RESTART_LIMIT_S


def http_get(path: str, timeout_s: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}{path}", timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_ingress_frontend_serves_sessions_one_ongoing_request_each(ray_server):
    cfg = VoxpipeConfig()
    cfg.admission = replace(cfg.admission, slo_ms=60000.0)  # as SERVE_ARGS: 2 busy cores
    cfg.llm = replace(cfg.llm, model="smollm2", device="cpu-fp32")
    t0 = time.monotonic()
    serve.run(build_ingress_app(cfg, {"frontend": {"max_ongoing_requests": 2}}, stages_app="voxpipe"),
              name="voxpipe-ingress", route_prefix="/")
    print(f"\ningress frontend ready in {time.monotonic() - t0:.1f} s (stats + warm-up through the stages)")
    url = f"ws://127.0.0.1:{HTTP_PORT}/ws"
    try:
        assert await asyncio.to_thread(http_get, "/healthz") == (200, "ready\n")
        status, page = await asyncio.to_thread(http_get, "/")
        assert status == 200 and "<html" in page.lower()
        status, text = await asyncio.to_thread(http_get, "/metrics")
        assert status == 200 and "voxpipe_" in text
        with pytest.raises(InvalidStatus) as refused:  # the edge's Origin check, before the upgrade
            await connect(url, origin="http://evil.example")
        assert refused.value.response.status_code == 403  # the edge's own response, passed by the proxy
        assert b"Origin" in bytes(refused.value.response.body or b"")
        async with Client(url) as a:  # a typed turn through the ingress: reply text and audio
            await a.start(sample_rate=16000, format="pcm16", channels=1, output_sample_rate=16000)
            await a.send_json({"type": "text.input", "text": TYPED})
            done = await a.wait_for("response.done")
            assert done["text"].strip(), done
            audio = [frame for frames in a.conv.audio.values() for frame in frames]
            assert audio and sum(map(len, audio)) >= 16000, "under 0.5 s of reply audio (16 kHz PCM16)"
            # max_ongoing_requests=2: two live WebSockets hold both; a third waits in the proxy
            async with Client(url) as b:
                await b.start(sample_rate=16000, format="pcm16", channels=1)
                third = asyncio.ensure_future(connect(url, open_timeout=120))  # an awaitable, not a coroutine
                await asyncio.sleep(3.0)
                assert not third.done(), "a third WebSocket was served beside two live ones"
                with pytest.raises(OSError):  # plain HTTP waits for a slot too (a timeout)
                    await asyncio.to_thread(http_get, "/healthz", 2.0)
            t_closed = time.monotonic()  # one closed: the queued handshake goes through
            ws3 = await asyncio.wait_for(third, 60)
            print(f"third WebSocket opened {time.monotonic() - t_closed:.2f} s after the second closed")
            await ws3.close()
    finally:
        serve.delete("voxpipe-ingress")
