"""The edge (server/edge.py, server/budget.py, the session loop of server/app.py): Host and
Origin checks, the bearer token, per-client budgets, idle sessions, close codes, no
compression. The real server over fake stages on loopback (these are about connections,
not models); the clients are the real ``websockets`` client and ``urllib``."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from clients.client import AccessDenied, ask
from pipeline import metrics
from pipeline.config import ServerConfig, VoxpipeConfig, is_loopback
from server.app import CLOSE_INTERNAL_ERROR
from server.budget import ClientBudget, TokenBucket
from server.edge import EdgeGuard
from tests.conftest import ROOT
from tests.fake_server import fake_server
from tests.fakes import FakeTts, fake_engines, pcm16, silence, tone

DEADLINE_S = 60.0
TOKEN = "s3cret-token"


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict, str]:
    """GET ``url`` (blocking: call through ``asyncio.to_thread``); (status, headers, body)."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


async def aget(url: str, **headers: str) -> tuple[int, dict, str]:
    return await asyncio.to_thread(get, url, headers)


async def until(ws, pred, deadline_s: float = DEADLINE_S) -> list[dict]:
    """JSON events from ``ws`` up to and including the first for which ``pred`` holds."""
    seen: list[dict] = []
    async with asyncio.timeout(deadline_s):
        while True:
            msg = await ws.recv()
            if isinstance(msg, bytes):
                continue
            seen.append(json.loads(msg))
            if pred(seen[-1]):
                return seen


def config(**server) -> VoxpipeConfig:
    return VoxpipeConfig(server=ServerConfig(**server))


# ---- Host and Origin ----------------------------------------------------------------------


async def test_a_loopback_server_refuses_a_foreign_host_name_dns_rebinding():
    async with fake_server() as srv:
        for host in (f"127.0.0.1:{srv.port}", f"localhost:{srv.port}", "[::1]", "localhost"):
            status, _, body = await aget(srv.http + "/metrics", Host=host)
            assert status == 200, (host, body)
        for host in ("evil.example", f"evil.example:{srv.port}", "127.0.0.1.evil.example", "0.0.0.0"):
            for path in ("/", "/metrics", "/ws"):
                status, _, body = await aget(srv.http + path, Host=host)
                assert status == 403 and "Host not allowed" in body, (host, path, status)
    async with fake_server(config(allow_hosts=("voice.example",))) as srv:
        assert (await aget(srv.http + "/", Host="voice.example:443"))[0] == 200
        assert (await aget(srv.http + "/", Host="other.example"))[0] == 403


async def test_a_cross_origin_websocket_is_refused_and_the_pages_own_origin_is_not():
    before = metrics.EDGE_REFUSALS.labels("origin")._value.get()
    async with fake_server() as srv:
        for origin in ("http://evil.example", f"http://127.0.0.1:{srv.port + 1}", "null",
                       f"http://localhost:{srv.port}", "file://"):
            with pytest.raises(InvalidStatus) as caught:
                await connect(srv.ws, origin=origin, open_timeout=DEADLINE_S)  # type: ignore[arg-type]
            assert caught.value.response.status_code == 403, origin
        assert metrics.EDGE_REFUSALS.labels("origin")._value.get() - before == 5
        for origin in (f"http://127.0.0.1:{srv.port}", None):  # the page's own origin; not a browser
            async with connect(srv.ws, origin=origin, open_timeout=DEADLINE_S) as ws:  # type: ignore[arg-type]
                await ws.send(json.dumps({"type": "session.start"}))
                await until(ws, lambda e: e["type"] == "session.started")
    async with fake_server(config(allow_origins=("http://app.example",))) as srv:
        async with connect(srv.ws, origin="http://app.example", open_timeout=DEADLINE_S):  # type: ignore[arg-type]
            pass
        with pytest.raises(InvalidStatus):
            await connect(srv.ws, origin="http://evil.example", open_timeout=DEADLINE_S)  # type: ignore[arg-type]
    async with fake_server(config(allow_origins=("*",))) as srv:
        async with connect(srv.ws, origin="http://evil.example", open_timeout=DEADLINE_S):  # type: ignore[arg-type]
            pass


def test_origin_rules_compare_scheme_host_and_default_ports():
    guard = EdgeGuard(ServerConfig())
    ok = lambda origin, host: guard.check("/ws", "", {"Host": host, "Origin": origin}) is None  # noqa: E731
    assert ok("http://localhost", "localhost:80") and ok("https://localhost:443", "localhost")
    assert ok("HTTP://LocalHost:8765", "localhost:8765")
    assert not ok("http://localhost:8765", "localhost:8766")
    assert not ok("http://localhost:99999", "localhost:8765")  # a bad port is no origin
    assert not ok("ws://localhost:8765", "localhost:8765")
    assert [is_loopback(h) for h in ("127.0.0.1", "127.9.9.9", "::1", "[::1]", "localhost", "a.localhost",
                                      "0.0.0.0", "::", "192.168.1.2", "example.com")] == [True] * 6 + [False] * 4


# ---- the token ----------------------------------------------------------------------------


async def test_the_token_is_needed_on_ws_as_a_bearer_header_or_a_query_parameter():
    async with fake_server(config(token=TOKEN)) as srv:
        for url, headers in ((srv.ws, {}), (srv.ws, {"Authorization": "Bearer wrong"}),
                             (srv.ws + "?token=wrong", {}), (srv.ws, {"Authorization": f"Basic {TOKEN}"})):
            with pytest.raises(InvalidStatus) as caught:
                await connect(url, additional_headers=headers, open_timeout=DEADLINE_S)
            assert caught.value.response.status_code == 401
            assert caught.value.response.headers["WWW-Authenticate"].startswith("Bearer")
        for url, headers in ((srv.ws, {"Authorization": f"Bearer {TOKEN}"}), (srv.ws + f"?token={TOKEN}", {})):
            async with connect(url, additional_headers=headers, open_timeout=DEADLINE_S) as ws:
                await ws.send(json.dumps({"type": "session.start"}))
                await until(ws, lambda e: e["type"] == "session.started")
        # a loopback server's /metrics, page and health stay open
        for path in ("/metrics", "/", "/healthz"):
            assert (await aget(srv.http + path))[0] == 200, path


async def test_metrics_need_the_token_when_the_server_is_exposed():
    exposed = config(host="0.0.0.0", token=TOKEN)  # the guard's view; the test still binds loopback
    async with fake_server(exposed) as srv:
        assert (await aget(srv.http + "/metrics"))[0] == 401
        status, _, body = await aget(srv.http + "/metrics", Authorization=f"Bearer {TOKEN}")
        assert status == 200 and "voxpipe_sessions" in body
        assert (await aget(srv.http + "/", Host="anything.example"))[0] == 200  # no --allow-host: no Host check


def test_a_non_loopback_host_without_a_token_is_a_clear_start_up_error():
    with pytest.raises(ValueError, match="not loopback, needs a token"):
        config(host="0.0.0.0").validate()
    config(host="0.0.0.0", token=TOKEN).validate()
    r = subprocess.run([sys.executable, "-m", "cli", "serve", "--host", "0.0.0.0"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "needs a token: set --token or VOXPIPE_TOKEN" in r.stderr, r.stderr[-2000:]


async def test_ask_passes_the_token_and_says_clearly_when_it_is_missing(tmp_path):
    import soundfile as sf

    clip = tmp_path / "words.wav"
    sf.write(clip, np.concatenate([tone(800), silence(700)]), 16000, subtype="PCM_16")
    async with fake_server(config(token=TOKEN)) as srv:
        with pytest.raises(AccessDenied, match=r"HTTP 401.*--token or set VOXPIPE_TOKEN"):
            await ask(str(clip), url=srv.ws, fast=True)
        res = await ask(str(clip), url=srv.ws, fast=True, token=TOKEN, timeout_s=DEADLINE_S)
        assert res.transcript and res.reply_text and not res.errors


# ---- budgets ------------------------------------------------------------------------------


async def answered_once_within_budget(ws) -> None:
    """A typed turn is refused (``busy`` ``rate_limited``) while the client is over its budget
    and answered once the refusal's ``retry_after_ms`` has passed."""
    for _ in range(5):
        await ws.send(json.dumps({"type": "text.input", "text": "and now?"}))
        last = (await until(ws, lambda e: e["type"] in ("busy", "response.done")))[-1]
        if last["type"] == "response.done":
            return
        assert last["reason"] == "rate_limited", last
        await asyncio.sleep(last["retry_after_ms"] / 1000)
    pytest.fail("still refused after 5 waits of its retry_after_ms")


def test_a_token_bucket_lets_a_burst_through_then_paces_at_its_rate():
    now = [0.0]
    bucket = TokenBucket(rate=3.0, burst=6.0, clock=lambda: now[0])
    assert bucket.take(6.0) == 0.0  # the burst
    assert bucket.take(3.0) == pytest.approx(1.0)  # in debt: 3 units at 3/s
    now[0] = 1.0  # the reader waited
    assert bucket.take(1.5) == pytest.approx(0.5)
    now[0] = 100.0  # idle: refilled up to the burst, not beyond
    assert bucket.take(6.0) == 0.0 and bucket.take(0.3) == pytest.approx(0.1)
    budget = ClientBudget(ServerConfig(text_rate=10, text_burst=2), clock=lambda: now[0])
    paces = [budget.text_frame(10) for _ in range(4)]
    assert [p.wait_s > 0 for p in paces] == [False, False, True, True]
    assert [p.warn for p in paces] == [False, False, True, False]  # told once, not per frame
    assert budget.text_frame(4 * 1024 * 1024).wait_s == pytest.approx((2 + 257) / 10)  # a big frame costs more
    now[0] = 200.0
    bucket = TokenBucket(rate=2.0, burst=1.0, clock=lambda: now[0])
    assert bucket.take(3.0, max_wait_s=0.5) is None and bucket.level == 1.0  # would wait 1 s: nothing taken
    assert bucket.take(2.0, max_wait_s=0.5) == pytest.approx(0.5)
    budget = ClientBudget(ServerConfig(audio_rate_x=1, audio_burst_s=1), clock=lambda: now[0])
    paces = [budget.audio_seconds(1.0, 0.5), budget.audio_seconds(1.0, 0.5), budget.audio_seconds(0.4, 0.5),
             budget.audio_seconds(1.0, 0.5)]
    assert [(p.dropped, p.warn) for p in paces] == [(False, False), (True, True), (False, True), (True, False)]


async def test_audio_faster_than_its_budget_is_slowed_never_dropped_and_never_slows_another_session():
    """A client sends 20 s of audio at once against a 1 s burst at 4x real time: it gets one
    ``rate_limited`` and its audio is read at 4x (all of it: 3 spoken turns are heard, in
    order, and a frame sent after the audio is answered after them), but its turns, which
    end while it is held back, are refused (``busy`` ``rate_limited``: no reply work);
    meanwhile another session's typed turn is answered before the throttled client's frames
    are through. Once it keeps to its budget, its turns are answered again."""
    cfg = config(audio_rate_x=4.0, audio_burst_s=1.0)
    turn = np.concatenate([tone(1000), silence(5000)])  # 6 s: silence over the merge window
    audio = pcm16(np.concatenate([turn, turn, turn, silence(2000)]))  # 20 s
    throttled = metrics.THROTTLED_SECONDS.labels("audio")._value.get()
    async with fake_server(cfg) as srv, connect(srv.ws) as flood, connect(srv.ws) as other:
        for ws in (flood, other):
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
            await until(ws, lambda e: e["type"] == "session.started")
        for i in range(0, len(audio), 64000):  # 2 s frames, sent at once
            await flood.send(audio[i:i + 64000])
        await flood.send("after the audio")  # not JSON: answered once all the audio before it is read
        first = await until(flood, lambda e: e["type"] == "error")
        assert first[-1]["code"] == "rate_limited" and not first[-1]["fatal"]
        await other.send(json.dumps({"type": "text.input", "text": "hello"}))
        await until(other, lambda e: e["type"] == "response.done")
        rest = await until(flood, lambda e: e["type"] == "error" and e["code"] == "bad_json")
        seen = first + rest
        assert sum(e["type"] == "speech.started" for e in seen) == 3, [e["type"] for e in seen]
        assert [e["code"] for e in seen if e["type"] == "error"] == ["rate_limited", "bad_json"]
        busy = [e for e in seen if e["type"] == "busy"]
        assert len(busy) == 3 and {e["reason"] for e in busy} == {"rate_limited"}, busy
        assert not [e for e in seen if e["type"] == "response.started"]
        # a refused turn keeps only the words its partials committed: no decode is spent on it
        assert not [e for e in seen if e["type"] == "transcript.final" and (e["source"], e["unanswered"]) !=
                    ("partial", True)]
        await answered_once_within_budget(flood)
    waited = metrics.THROTTLED_SECONDS.labels("audio")._value.get() - throttled
    assert waited >= 3.0  # 20 s at 4x after a 1 s burst: (20 - 1) / 4 = 4.75 s, less the time spent reading


async def test_a_frame_holding_minutes_of_audio_is_read_up_to_the_stall_limit_and_the_rest_dropped():
    """8 kHz PCM16 in one 480 KB frame is 30 s of audio; at 2x real time after a 1 s burst,
    with one frame allowed to stall the reader 1 s, about 3 s are read and 27 s dropped —
    said in ``rate_limited`` (once for the wait, once for the drop) and counted; the
    session goes on."""
    cfg = config(audio_rate_x=2.0, audio_burst_s=1.0, read_stall_s=1.0)
    dropped = metrics.AUDIO_DROPPED._value.get()
    async with fake_server(cfg) as srv, connect(srv.ws) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": 8000}))
        await until(ws, lambda e: e["type"] == "session.started")
        await ws.send(bytes(30 * 8000 * 2))
        seen = await until(ws, lambda e: e["type"] == "error" and "dropped" in e["message"])
        errors = [e for e in seen if e["type"] == "error"]
        assert [e["code"] for e in errors] == ["rate_limited"] * 2, errors  # slowed, then dropped: told each once
        assert "read at that rate" in errors[0]["message"] and "s of audio dropped" in errors[1]["message"]
        await answered_once_within_budget(ws)
    assert 25.0 <= metrics.AUDIO_DROPPED._value.get() - dropped <= 28.0


async def test_empty_frames_and_frames_before_session_start_are_paced_too():
    """A frame costs at least 2 ms of audio whatever it holds, and binary frames before
    ``session.start`` count as text frames: a flood of either is throttled."""
    async with fake_server(config(audio_rate_x=1.0, audio_burst_s=0.1, text_rate=50, text_burst=5)) as srv:
        async with connect(srv.ws) as ws:
            for _ in range(20):  # no session yet
                await ws.send(b"\x00\x00")
            await ws.send("after")
            codes = [e["code"] for e in await until(ws, lambda e: e.get("code") == "bad_json")]
            assert codes.count("no_session") == 20 and codes.count("rate_limited") == 1, codes
        async with connect(srv.ws) as ws:
            await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
            await until(ws, lambda e: e["type"] == "session.started")
            for _ in range(200):  # 0.4 s of budget in empty frames
                await ws.send(b"")
            await ws.send("after")
            codes = [e["code"] for e in await until(ws, lambda e: e.get("code") == "bad_json")]
            assert codes == ["rate_limited", "bad_json"], codes


async def test_text_frames_beyond_their_budget_are_slowed_and_all_answered():
    async with fake_server(config(text_rate=50, text_burst=5)) as srv, connect(srv.ws) as ws:
        for i in range(40):
            await ws.send(json.dumps({"type": f"nope{i}"}))
        seen = await until(ws, lambda e: e.get("message", "").startswith("unknown event type 'nope39'"))
        codes = [e["code"] for e in seen]
        assert codes.count("unknown_type") == 40 and codes.count("rate_limited") == 1


# ---- keepalive ------------------------------------------------------------------------------


async def test_a_throttled_client_whose_pong_waits_behind_its_frames_is_not_closed_by_the_keepalive():
    """24 s of audio at 4x real time takes the server ~6 s to read; the client's pongs to the
    server's 1 s keepalive pings wait behind it in TCP. The frames count as signs of life:
    the connection stays open and the frame after the audio is answered."""
    cfg = config(audio_rate_x=4.0, audio_burst_s=0.5, keepalive_s=1.0)
    async with fake_server(cfg) as srv, connect(srv.ws, ping_interval=None) as ws:
        await ws.send(json.dumps({"type": "session.start", "sample_rate": 16000}))
        await until(ws, lambda e: e["type"] == "session.started")
        frame = bytes(3200)  # 0.1 s
        for _ in range(240):
            await ws.send(frame)
        await ws.send("after the audio")
        seen = await until(ws, lambda e: e["type"] == "error" and e["code"] == "bad_json")
        assert [e["code"] for e in seen if e["type"] == "error"] == ["rate_limited", "bad_json"]


async def test_a_peer_that_answers_nothing_is_closed_by_the_keepalive():
    """A raw TCP client completes the WebSocket handshake, then neither answers pings nor
    sends: the server closes it (1011) after the pong timeout."""
    import base64
    import os

    closed = metrics.SESSIONS_CLOSED.labels("keepalive")._value.get()
    async with fake_server(config(keepalive_s=0.5)) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                     .encode())
        await writer.drain()
        assert (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), DEADLINE_S)).startswith(b"HTTP/1.1 101")
        data = b""
        async with asyncio.timeout(DEADLINE_S):
            while b"keepalive" not in data:  # pings, then the close frame (code, reason)
                chunk = await reader.read(65536)
                assert chunk, f"EOF before a close frame: {data!r}"
                data += chunk
        writer.close()
        close = data[data.rindex(b"\x88"):]  # the close frame: opcode 8, code 1011
        assert int.from_bytes(close[2:4], "big") == 1011 and b"keepalive" in close, data
        for _ in range(int(DEADLINE_S / 0.05)):
            if srv.app.sessions == 0:
                break
            await asyncio.sleep(0.05)
        assert srv.app.sessions == 0
        assert metrics.SESSIONS_CLOSED.labels("keepalive")._value.get() == closed + 1  # not "client"


# ---- idle sessions, close codes, compression ---------------------------------------------


async def test_an_idle_session_is_closed_with_a_reason_and_counted():
    idle_before = metrics.SESSIONS_CLOSED.labels("idle")._value.get()
    async with fake_server(config(idle_timeout_s=0.5)) as srv, connect(srv.ws) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        seen = await until(ws, lambda e: e["type"] == "error")
        assert seen[-1]["code"] == "idle_timeout" and seen[-1]["fatal"]
        with pytest.raises(ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), DEADLINE_S)
        assert closed.value.rcvd is not None and (closed.value.rcvd.code, closed.value.rcvd.reason) == (1000, "idle")
    assert metrics.SESSIONS_CLOSED.labels("idle")._value.get() == idle_before + 1


async def test_an_idle_timeout_waits_for_the_reply_in_progress():
    """A user listening to a reply is not idle: with a 0.5 s timeout and a reply whose speech
    takes 1.5 s to make, the reply ends (``response.done``) before ``idle_timeout``."""
    engines = fake_engines(tts=FakeTts(delay_s=1.5))
    async with fake_server(config(idle_timeout_s=0.5), engines) as srv, connect(srv.ws) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        await until(ws, lambda e: e["type"] == "session.started")
        await ws.send(json.dumps({"type": "text.input", "text": "tell me"}))
        seen = await until(ws, lambda e: e["type"] in ("error", "response.done"))
        assert seen[-1]["type"] == "response.done", seen
        done_t = time.monotonic()
        seen = await until(ws, lambda e: e["type"] == "error")
        assert seen[-1]["code"] == "idle_timeout", seen
        # a full idle period after the reply's end (its audio plays on at the client): a lower
        # bound the server's own timer sets, which a slow machine only lengthens
        assert time.monotonic() - done_t >= 0.4


async def test_duplicate_host_origin_or_authorization_headers_are_a_400_not_a_traceback(caplog):
    async with fake_server(config(token=TOKEN)) as srv:
        for dup in ("Host: evil.example", "Origin: http://evil.example", f"Authorization: Bearer {TOKEN}"):
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nOrigin: http://127.0.0.1:{srv.port}\r\n"
                          f"Authorization: Bearer {TOKEN}\r\n{dup}\r\n\r\n").encode())
            await writer.drain()
            status = await asyncio.wait_for(reader.readline(), DEADLINE_S)
            writer.close()
            assert status.startswith(b"HTTP/1.1 400"), (dup, status)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


async def test_a_session_failing_on_an_internal_error_closes_with_1011_and_others_go_on(monkeypatch):
    from pipeline.session.session import Session

    async def broken(self, req):
        raise RuntimeError("a bug")

    async with fake_server() as srv, connect(srv.ws) as healthy:
        await healthy.send(json.dumps({"type": "session.start"}))
        await until(healthy, lambda e: e["type"] == "session.started")
        monkeypatch.setattr(Session, "start", broken)
        async with connect(srv.ws) as ws:
            await ws.send(json.dumps({"type": "session.start"}))
            seen = await until(ws, lambda e: e["type"] == "error")
            assert seen[-1]["code"] == "internal" and seen[-1]["fatal"]
            with pytest.raises(ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), DEADLINE_S)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == CLOSE_INTERNAL_ERROR
        await healthy.send(json.dumps({"type": "text.input", "text": "still there?"}))
        await until(healthy, lambda e: e["type"] == "response.done")


async def test_per_message_deflate_is_declined():
    """A client offering permessage-deflate (websockets does by default) gets no compression:
    a 4 MiB frame costs 4 MiB on the wire, not 4 KB that inflate to 4 MiB on the server."""
    async with fake_server() as srv, connect(srv.ws, compression="deflate") as ws:
        assert ws.response is not None and "Sec-WebSocket-Extensions" not in ws.response.headers
        assert ws.protocol.extensions == []
