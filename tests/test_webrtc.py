"""Sessions over WebRTC (server/webrtc/, ``POST /webrtc/offer``): an aiortc client and a
headless Chromium talk to the server over a real peer connection on this machine (Opus both
ways, events on the ``events`` data channel).

The fast tests run the real server over fake stages (tests/fake_server.py: a tone is speech
with words) in this process: a turn end to end, bad offers, the edge's refusals, a server
without aiortc. The slow ones run the real models (the shared ``server`` fixture) with real
speech: a conversation, the same with 5 % of the Opus packets lost and 2 % reordered, and
the web page in Chromium with its fake microphone.
"""

from __future__ import annotations

import ast
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import soxr

from clients.rtc import RATE, RtcClient, post
from pipeline import metrics
from pipeline.config import ServerConfig, VoxpipeConfig
from server.webrtc.jitter import InlineDecoding
from server.webrtc.tracks import SETTLE_FRAMES
from tests.conftest import ROOT
from tests.fake_server import fake_server
from tests.fakes import Delta, FakeLlm, FakeTts, LlmReply, fake_engines
from tests.wsclient import normalize, wer

DEADLINE_S = 60.0  # fake stages: bounds a hang only
MODEL_DEADLINE_S = 300.0  # real models on a busy 2-core machine: bounds a hang only
JFK = "en_jfk_inaugural_1961.wav"


def tone_clip(speech_s: float = 1.5, lead_s: float = 0.5, tail_s: float = 1.0) -> np.ndarray:
    """Int16 mono at 48 kHz: silence, a 220 Hz tone (speech with words to the fake stages), silence."""
    t = np.arange(int(speech_s * RATE)) / RATE
    x = np.concatenate([np.zeros(int(lead_s * RATE)), 0.3 * np.sin(2 * np.pi * 220 * t), np.zeros(int(tail_s * RATE))])
    return (x * 32767).astype(np.int16)


def speech_clip(path: Path, lead_s: float = 0.5) -> np.ndarray:
    """A test clip as int16 mono at 48 kHz, after ``lead_s`` of silence (then the track plays silence)."""
    x, sr = sf.read(path, dtype="float32", always_2d=True)
    x = soxr.resample(x.mean(axis=1), sr, RATE)
    return (np.concatenate([np.zeros(int(lead_s * RATE), np.float32), x]) * 32767).astype(np.int16)


def config(**server) -> VoxpipeConfig:
    return VoxpipeConfig(server=ServerConfig(**server))


class StoryLlm(FakeLlm):
    """Says "Okay." unless asked for a story: then about 20 s of speech (with the TTS below)."""

    def submit(self, req):
        story = "story" in str(req.messages[-1]["content"])
        self.default = LlmReply([Delta(f"This is sentence {i} of a long story. ", 0.02) for i in range(12)]
                                if story else [Delta("Okay.")])
        return super().submit(req)


def engines():
    # the reply a tone: Opus keeps it (a constant level, FakeTts's default, it drops)
    return fake_engines(llm=StoryLlm(), tts=FakeTts(hz=440, s_per_char=0.05))


async def apost(url: str, body: bytes | str, **headers: str) -> tuple[int, dict, str]:
    return await asyncio.to_thread(post, url, body, headers)


# ---- fake stages: the session behind a peer connection ------------------------------------------


async def test_a_spoken_turn_and_a_typed_one_over_webrtc_and_the_session_ends_with_the_peer():
    """The tone goes out as Opus, the session hears a turn, its reply comes back on the
    track (loud) with its events on the channel; a typed turn and a cancel go over the
    channel; the session is counted in the server's sessions while the peer lives."""
    closed = metrics.SESSIONS_CLOSED.labels("client")._value.get()
    async with fake_server(engines=engines()) as srv:
        c = RtcClient(srv.http, tone_clip())
        await c.connect()
        started = await c.wait_until(lambda: c.of("session.started"), DEADLINE_S, "session.started")
        # the decoded track's format in, the reply track's out; Opus on the wire both ways
        assert started[0]["input"] == {"sample_rate": 48000, "format": "pcm16", "channels": 2}, started
        assert started[0]["output"] == {"sample_rate": 48000, "format": "pcm16", "channels": 1}, started
        assert srv.app.sessions == 1 and len(srv.app.webrtc.peers) == 1
        receiver = next(t.receiver for t in next(iter(srv.app.webrtc.peers)).pc.getTransceivers() if t.kind == "audio")
        inline = receiver._RTCRtpReceiver__decoder_queue  # the microphone decoded on the loop, not in a thread
        assert isinstance(inline, InlineDecoding), inline
        done = (await c.wait_until(lambda: c.of("response.done"), DEADLINE_S, "the reply"))[0]
        assert c.of("transcript.final")[0]["text"].strip() and inline.frames > 0
        rid = done["response_id"]
        begun = c.at(c.of("response.started")[0])
        await c.wait_until(lambda: c.heard.loud_s(begun) >= 0.8 * done["audio_s"], DEADLINE_S, "the reply heard")

        # a typed turn, then a cancel over the channel: the track goes quiet at once
        c.send({"type": "text.input", "text": "Tell me a long story about the sea, please, a very long one."})
        await c.wait_until(lambda: any(e["response_id"] > rid for e in c.of("response.started")), DEADLINE_S,
                           "the typed turn's reply")
        await c.wait_until(lambda: c.heard.first_loud(c.at(c.of("response.started")[-1])), DEADLINE_S,
                           "its audio")
        c.send({"type": "response.cancel"})
        cancelled = (await c.wait_until(lambda: c.of("response.cancelled"), DEADLINE_S, "the cancel"))[0]
        assert cancelled["reason"] == "client"
        await asyncio.sleep(0.5)  # frames already on the way (Opus, jitter buffer) go by
        quiet_from, frames = time.monotonic(), len(c.heard.times)
        await asyncio.sleep(0.6)
        assert c.heard.loud_s(quiet_from) == 0.0, "reply audio after its response.cancelled"
        # between replies the track sends nothing (its settling frames at most), not 50 packets a second
        assert len(c.heard.times) - frames <= SETTLE_FRAMES, len(c.heard.times) - frames
        assert srv.app.webrtc.peers and not [e for e in c.events if e["type"] == "error"], c.events

        sent, received = await c.bytes_moved()
        assert sent > 0 and received > 0
        await c.close()  # the peer goes: so does its session
        for _ in range(100):
            if srv.app.sessions == 0:
                break
            await asyncio.sleep(0.1)
        assert srv.app.sessions == 0 and not srv.app.webrtc.peers
    assert metrics.SESSIONS_CLOSED.labels("client")._value.get() == closed + 1


async def test_a_truncated_or_bad_offer_gets_a_clear_400_and_the_session_already_open_goes_on():
    async with fake_server(engines=engines()) as srv:
        good = RtcClient(srv.http)
        await good.connect()
        await good.wait_until(lambda: good.of("session.started"), DEADLINE_S, "session.started")

        probe = RtcClient(srv.http)  # only its offer is used
        await probe.pc.setLocalDescription(await probe.pc.createOffer())
        sdp = probe.pc.localDescription.sdp
        url = srv.http + "/webrtc/offer"
        for cut in (len(sdp) // 4, len(sdp) // 2, 3 * len(sdp) // 4, len(sdp) - 40):
            body = json.dumps({"type": "offer", "sdp": sdp[:cut]})
            status, _, text = await apost(url, body)
            assert status == 400, (cut, status, text)
            assert text.startswith(("the SDP offer is incomplete or malformed (truncated?): ",
                                    "the SDP offer cannot be answered: ")), (cut, text)
            assert "NoneType" not in text and "Error" not in text, text  # aiortc's own words never reach the client
        no_channel = "".join(ln + "\r\n" for ln in sdp.split("\r\n")[:-1] if not ln.startswith("a=sctp"))
        no_channel = no_channel.split("m=application")[0]
        for body, says in (
            ("not json", "the body is not JSON"),
            ("[1]", "must be a JSON object, got an array"),
            (json.dumps({"type": "answer", "sdp": sdp}), "type is 'answer'"),
            (json.dumps({"type": "offer"}), "sdp must be the offer's SDP text"),
            (json.dumps({"type": "offer", "sdp": sdp, "session": {"vad": "yes"}}), "session: vad"),
            (json.dumps({"type": "offer", "sdp": sdp, "session": []}), "session must be an object"),
            (json.dumps({"type": "offer", "sdp": no_channel}), "no data channel section"),
            (json.dumps({"type": "offer", "sdp": "v=0\r\n" + "a=x\r\n" * 20_000}), "request body over"),
        ):
            status, _, text = await apost(url, body)
            assert status in (400, 413) and says in text, (says, status, text)
        from tests.test_edge import aget

        status, hdrs, text = await aget(url)  # a GET goes to the other HTTP stack: the same answer
        assert status == 405 and hdrs["Allow"] == "POST" and "use POST" in text, (status, text)
        await probe.close()
        assert srv.app.sessions == 1 and len(srv.app.webrtc.peers) == 1  # nothing was left behind

        # the open session goes on
        good.send({"type": "text.input", "text": "Hello?"})
        await good.wait_until(lambda: good.of("response.done"), DEADLINE_S, "a reply after the bad offers")
        good.send({"type": "text.input", "text": "   "})  # a bad event over the channel: an error, the session goes on
        err = await good.wait_until(lambda: good.of("error"), DEADLINE_S, "the error")
        assert err[0]["code"] == "bad_event" and not err[0]["fatal"], err
        good.send({"type": "session.end"})
        for _ in range(100):
            if srv.app.sessions == 0:
                break
            await asyncio.sleep(0.1)
        assert srv.app.sessions == 0
        await good.close()


async def test_the_edge_refuses_an_offer_as_it_refuses_ws_and_the_session_cap_is_shared():
    token = "s3cret-token"
    async with fake_server(config(token=token, max_sessions=1), engines=engines()) as srv:
        url = srv.http + "/webrtc/offer"
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            status, hdrs, text = await apost(url, "{}", **headers)
            assert status == 401 and hdrs["www-authenticate"].startswith("Bearer"), (status, text)
            assert "a valid token is required" in text
        status, _, text = await apost(url, "{}", Authorization=f"Bearer {token}", Origin="http://evil.example")
        assert status == 403 and "Origin 'http://evil.example' not allowed" in text, text
        status, _, text = await apost(url, "{}", Authorization=f"Bearer {token}", Host="evil.example")
        assert status == 403 and "Host not allowed" in text, text

        # the page's own origin with the token as a query parameter: a session
        own = {"Origin": f"http://127.0.0.1:{srv.port}"}
        first = RtcClient(srv.http)
        status, _, body = await asyncio.to_thread(
            post, f"{url}?token={token}",
            json.dumps({"type": "offer", "sdp": await _offer_sdp(first)}), own)
        assert status == 200 and json.loads(body)["type"] == "answer", (status, body)
        # the cap (1) is full: another offer and a /ws both get 503 with Retry-After
        second = RtcClient(srv.http, headers={"Authorization": f"Bearer {token}"})
        status, hdrs, text = await second.offer()
        assert status == 503 and hdrs["retry-after"] == "5" and text.startswith("server full: 1 sessions"), text
        from tests.test_edge import aget

        status, _, text = await aget(srv.ws.replace("ws:", "http:") + f"?token={token}")
        assert status == 503 and "server full" in text, (status, text)
        app = srv.app
        assert len(app.webrtc.peers) == 1  # the first (never connected) is open when the server stops
    assert not app.webrtc.peers and app.sessions == 0  # the server's close closed it and its session
    await first.close()
    await second.close()

    async with fake_server(engines=engines()) as srv:
        srv.app.ready = False
        status, hdrs, text = await RtcClient(srv.http).offer()
        assert status == 503 and "warming up" in text and hdrs["retry-after"] == "5", text


async def test_without_aiortc_an_offer_gets_501_saying_how_to_install_it_and_the_rest_serves(monkeypatch):
    for name in [m for m in sys.modules if m == "aiortc" or m.startswith(("aiortc.", "server.webrtc.peer",
                                                                            "server.webrtc.tracks",
                                                                            "server.webrtc.outbox",
                                                                            "server.webrtc.jitter"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "aiortc", None)  # import aiortc now fails
    async with fake_server(engines=engines()) as srv:
        status, _, text = await apost(srv.http + "/webrtc/offer", json.dumps({"type": "offer", "sdp": "v=0"}))
        assert status == 501 and "pip install 'voxpipe[webrtc]'" in text, (status, text)
        from tests.test_edge import aget

        assert (await aget(srv.http + "/healthz"))[0] == 200


def test_only_the_peer_modules_import_aiortc_and_nothing_imports_them_at_start():
    """A server without aiortc starts: aiortc is imported by server/webrtc/{peer,tracks,outbox,jitter}.py
    (and the client, clients/rtc.py) only, and those only by each other or inside a function (the
    endpoint, on the first offer)."""
    heavy = {"server.webrtc.peer", "server.webrtc.tracks", "server.webrtc.outbox", "server.webrtc.jitter",
             "clients.rtc"}  # the client: imported by the tests, and by bench voice inside a function
    for path in sorted(p for pkg in ("audio", "pipeline", "server", "clients", "cli", "bench")
                       for p in (ROOT / pkg).rglob("*.py")):
        rel = path.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        names = set()
        for node in top:
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            else:
                base = node.module or ""
                if node.level:  # relative: resolve against the package
                    pkg = module.split(".")[: -node.level]
                    base = ".".join([*pkg, base] if base else pkg)
                names |= {base} | {f"{base}.{a.name}" for a in node.names}
        if module not in heavy:
            assert not any(n == "aiortc" or n.startswith("aiortc.") for n in names), module
            assert not names & heavy, f"{module} imports {names & heavy} at start"


async def _offer_sdp(client: RtcClient) -> str:
    await client.pc.setLocalDescription(await client.pc.createOffer())
    return client.pc.localDescription.sdp


def test_the_page_over_webrtc_talks_with_its_token_and_says_why_it_is_refused_without_it(tmp_path):
    """The page set to WebRTC (fake stages): a spoken turn (Chromium's fake microphone plays
    a tone) and a typed one are answered, the replies play from the track, the events came
    on the data channel; opened without the server's token it says a token is needed."""
    from tests.fake_server import fake_server_thread
    from tests.test_web import launch, wait
    from tests.test_web_ui import mic_wav, new_page, send_text

    token = "page-token"
    wav = mic_wav(tmp_path / "mic.wav", ("silence", 0.5), ("tone", 1.5), ("silence", 5))
    with launch(f"--use-file-for-fake-audio-capture={wav}%noloop") as b, \
            fake_server_thread(config(token=token), engines()) as srv:
        page, errors = new_page(b, srv.http, f"/?token={token}&transport=webrtc")
        page.click("#start")
        wait(page, "window.voxpipe.events.some(e => e.type === 'response.done')", timeout_s=60,
             what="the reply to the spoken turn")
        send_text(page, "Hello?")
        wait(page, "window.voxpipe.events.filter(e => e.type === 'response.done').length >= 2", timeout_s=60,
             what="the reply to the typed turn")
        wait(page, "window.voxpipe.rtc.totalAudioEnergy > 0.001 && window.voxpipe.rtc.elementPlaying",
             timeout_s=30, what="the replies played from the track")
        vp = page.evaluate("window.voxpipe")
        assert vp["transport"] == "webrtc" and vp["sessions"] == 1 and vp["audioFramesSent"] == 0, vp["rtc"]
        assert [e["type"] for e in vp["sent"]][-1] == "text.input" and not errors, errors
        assert srv.app.sessions == 1

        page, _ = new_page(b, srv.http, "/?transport=webrtc")  # no token
        send_text(page, "Hello?")
        refused = wait(page, "window.voxpipe.refused", timeout_s=60, what="the page to say why it was refused")
        assert refused["status"] == 401 and "token is required" in refused["message"], refused
        wait(page, "window.voxpipe.status === 'refused: token needed'", timeout_s=30, what="the status badge")
        assert page.evaluate("window.voxpipe.reconnects") == []  # refused for good: no retry


# ---- real models, real speech --------------------------------------------------------------------


def speech_end_s(pcm: np.ndarray) -> float:
    """Where the speech of ``pcm`` (int16, 48 kHz) ends (s): the end of its last 20 ms with an
    RMS over a tenth of its loudest (JFK's clip has 0.7 s of quiet breath after its last word)."""
    frames = pcm[: len(pcm) // 960 * 960].astype(np.float32).reshape(-1, 960)
    rms = np.sqrt((frames**2).mean(axis=1))
    return (int(np.nonzero(rms > 0.1 * rms.max())[0][-1]) + 1) * 0.02


async def _conversation(server, audio_dir, manifest, loss=None) -> tuple[RtcClient, dict, str]:
    """JFK as the microphone over WebRTC: (the client, the reply to the whole clip's
    response.done, the transcript it answered). Earlier replies (to the clip's first words,
    before a pause) may come and go: the one waited for starts after the clip's last
    ``speech.stopped``."""
    clip = speech_clip(audio_dir / JFK)
    c = RtcClient(server["http"], clip, loss=loss)
    t0 = time.monotonic()
    await c.connect()
    connected_s = time.monotonic() - t0

    def answered():
        if c.mic.done_at is None:
            return None
        stops = [e for e in c.of("speech.stopped") if c.at(e) >= c.mic.done_at - 0.5]  # the clip's last speech
        if not stops:
            return None
        starts = [e for e in c.of("response.started") if c.at(e) >= c.at(stops[-1])]
        rid = starts[-1]["response_id"] if starts else None
        return next((e for e in c.of("response.done") if e["response_id"] == rid), None)

    done = await c.wait_until(answered, MODEL_DEADLINE_S, "the reply to the clip")
    begun = c.at(next(e for e in c.of("response.started") if e["response_id"] == done["response_id"]))
    await c.wait_until(lambda: c.heard.loud_s(begun) >= 0.3 * done["audio_s"], MODEL_DEADLINE_S,
                       "the reply heard on the track")
    final = [e for e in c.of("transcript.final") if not e["unanswered"]][-1]["text"]
    first_loud = c.heard.first_loud(begun)
    assert c.mic.t0 is not None and first_loud is not None
    spoken_end = c.mic.t0 + speech_end_s(clip)  # when the clip's last word went out
    sent, received = await c.bytes_moved()
    talk_s = time.monotonic() - t0
    errors = [e for e in c.events if e["type"] == "error"]
    assert not errors, errors
    print(f"\nWebRTC{' with loss ' + str(c.lost) if loss else ''}: connected in {connected_s * 1000:.0f} ms; "
          f"transcript {final!r}; reply {done['text'][:80]!r}: {done['audio_s']:.1f} s, heard "
          f"{c.heard.loud_s(begun):.1f} s loud; voice-to-voice {done['timings_ms']['voice_to_voice']:.0f} ms at the "
          f"server, {(first_loud - spoken_end) * 1000:.0f} ms from the last word sent to the reply's first loud "
          f"frame received; {sent / talk_s / 1000:.1f} KB/s up, {received / talk_s / 1000:.1f} KB/s down over "
          f"{talk_s:.0f} s")
    return c, done, final


@pytest.mark.slow
async def test_a_spoken_conversation_over_webrtc_with_real_models(server, audio_dir, manifest):
    c, done, final = await _conversation(server, audio_dir, manifest)
    try:
        assert wer(manifest[JFK]["reference_transcript"], final) <= 0.3, final
        assert done["text"].strip() and not done["text_only"], done
    finally:
        await c.close()


@pytest.mark.slow
async def test_5_percent_of_opus_packets_lost_and_2_percent_reordered_the_turn_and_reply_survive(
        server, audio_dir, manifest):
    c, done, final = await _conversation(server, audio_dir, manifest, loss=(0.05, 0.02, 7))
    try:
        lost = c.lost
        assert lost is not None and lost.packets > 400, lost  # 11.5 s of 20 ms packets and more
        assert 0.03 <= lost.dropped / lost.packets <= 0.07 and 0.01 <= lost.reordered / lost.packets <= 0.03, lost
        words = normalize(final).split()
        for key in ("americans", "ask", "country"):
            assert key in words, final
        assert wer(manifest[JFK]["reference_transcript"], final) <= 0.4, final
        assert done["text"].strip(), done
    finally:
        await c.close()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_web_page_holds_a_spoken_conversation_over_webrtc(server, audio_dir, manifest, tmp_path):
    """Chromium's fake microphone plays JFK into the page set to WebRTC: the transcript is on
    screen, the reply's words too, and its audio plays from the reply track."""
    from tests.test_web import fake_mic_wav, launch, wait
    from tests.test_web_ui import new_page, screen, shots

    wav = tmp_path / "mic.wav"
    mic_s = fake_mic_wav(audio_dir, wav)  # the clip with silence around it
    with launch(f"--use-file-for-fake-audio-capture={wav}%noloop") as b:
        page, errors = new_page(b, server["http"], "/?transport=webrtc")
        assert page.evaluate("window.voxpipe.transport") == "webrtc"
        assert page.is_checked("#webrtc")
        page.click("#start")
        wait(page, "window.voxpipe.micActive && window.voxpipe.rtc.state === 'connected'", timeout_s=120,
             what="the peer connection")
        page.wait_for_timeout(mic_s * 1000)  # the whole file played (replies to its first words may come and go)
        rid = wait(page, """() => {  // the reply that began after the last speech.stopped, once done
            const ev = window.voxpipe.events, last = ev.map(e => e.type).lastIndexOf('speech.stopped');
            const start = last < 0 ? null : ev.slice(last).find(e => e.type === 'response.started');
            const done = start && ev.find(e => e.type === 'response.done' && e.response_id === start.response_id);
            return done ? done.response_id : null;
        }""", timeout_s=MODEL_DEADLINE_S, what="the reply to the spoken turn")
        wait(page, "window.voxpipe.rtc.totalAudioEnergy > 0.002 && window.voxpipe.rtc.elementPlaying",
             timeout_s=120, what="the reply's audio played")
        s = screen(page)
        vp = page.evaluate("window.voxpipe")
        final = s["users"][-1]["text"]
        assert wer(manifest[JFK]["reference_transcript"], final) <= 0.3, s
        reply = vp["responses"][str(rid)]
        assert reply["text"].strip() and s["replies"][-1]["text"].strip() == reply["text"].strip(), (s, reply)
        assert s["conn"] == "connected · WebRTC", s
        assert vp["audioFramesSent"] == 0  # the audio went on the track, not as messages
        shots(page, "webrtc-conversation")
        rtc = vp["rtc"]
        print(f"\nChromium over WebRTC: answer in {rtc['answerMs']} ms, connected in {rtc['connectedMs']} ms; "
              f"transcript {final!r}; reply {reply['text'][:80]!r}; {rtc['bytesSent']} B up, "
              f"{rtc['bytesReceived']} B down; jitter buffer {rtc['jitterBufferMs']} ms; "
              f"audio energy {rtc['totalAudioEnergy']:.4f} over {rtc['totalSamplesDuration']:.1f} s")
        assert not errors, errors
