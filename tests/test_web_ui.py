"""The web page (web/) as a person sees it, in a real headless Chromium.

Chromium's fake microphone plays a WAV file; the tests read what is on screen (badges,
banners, bubbles, meters, buttons) and, for what a screen cannot show (samples played, the
backoff delays), the page's ``window.voxpipe``. The fast tests run the real server
(``VoxpipeServer``) over scripted fake stages (tests/fake_server.py: a tone is speech with
words) or a scripted server (tests/scripted_server.py: exact event sequences); the slow one
runs the real models with real speech. Every stage is screenshotted at desktop (1280×800)
and phone (375×800) size into ``$VOXPIPE_ARTIFACTS/web`` (default tests/artifacts/web).
"""

from __future__ import annotations

import os
import struct
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.session import events as ev
from tests.conftest import ROOT, free_port, running_server
from tests.fake_server import fake_server_thread
from tests.fakes import Delta, FakeLlm, FakeTts, LlmReply, fake_engines
from tests.scripted_server import scripted_server, server_event
from tests.test_web import JFK, launch, wait
from tests.wsclient import wer

ARTIFACTS = Path(os.environ.get("VOXPIPE_ARTIFACTS", ROOT / "tests" / "artifacts")) / "web"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 375, "height": 800}
MIC_RATE = 48000

# What is on screen, read in the page.
SCREEN = """() => {
  const q = (s) => document.querySelector(s), all = (s) => [...document.querySelectorAll(s)];
  const banner = q('#banner');
  const bubble = (e) => ({text: e.querySelector('.text').innerText, meta: e.querySelector('.meta').innerText,
                          final: e.dataset.final, reason: e.dataset.reason || null,
                          cancelled: e.classList.contains('cancelled'),
                          unstable: (e.querySelector('.unstable') || {}).innerText || '',
                          committed: (e.querySelector('.committed') || {}).innerText || ''});
  return {
    state: q('#speech').innerText, stateKey: q('#speech').dataset.state,
    conn: q('#status').innerText, connKey: q('#status').dataset.state,
    banner: banner.hidden ? null : {kind: banner.dataset.kind, text: banner.innerText},
    users: all('#conversation .msg.user').map(bubble),
    replies: all('#conversation .msg.assistant:not(.busy)').map(bubble),
    cancelEnabled: !q('#cancel').disabled, startEnabled: !q('#start').disabled,
    talkVisible: !q('#talk').hidden, outActive: q('#out-meter').classList.contains('active'),
    micLevel: parseFloat(q('#mic-level').style.width || '0'), logOpen: q('#log-box').open,
  };
}"""


def screen(page) -> dict:
    return page.evaluate(f"({SCREEN})()")


def until(page, cond: str, what: str, timeout_s: float = 120) -> dict:
    """Wait until the screen ``s`` satisfies ``cond`` (JS); returns that screen."""
    return wait(page, f"() => {{ const s = ({SCREEN})(); return ({cond}) ? s : null; }}", timeout_s=timeout_s,
                what=what)


def shots(page, name: str) -> list[Path]:
    """Screenshot the page at desktop and phone size (full page) as ``NAME-desktop.png`` and
    ``NAME-phone.png``; the viewport is back at desktop size after."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    paths = []
    for label, size in (("phone", PHONE), ("desktop", DESKTOP)):
        page.set_viewport_size(size)
        path = ARTIFACTS / f"{name}-{label}.png"
        page.screenshot(path=path, full_page=True)
        paths.append(path)
    return paths


def new_page(b, http: str, path: str = "/", init: str | None = None):
    """A page on ``http + path`` at desktop size (``init``: a script run before the page's
    own); returns it with the list its JS errors go to."""
    ctx = b.new_context(viewport=DESKTOP)
    ctx.set_default_timeout(120_000)
    if init:
        ctx.add_init_script(init)
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(http + path)
    return page, errors


def mic_wav(path: Path, *parts: tuple[str, float]) -> Path:
    """A fake-microphone WAV (PCM16 mono, 48 kHz): ``("tone", s)`` (speech with words to the
    fake stages) and ``("silence", s)`` parts in order."""
    chunks = []
    for kind, s in parts:
        n = int(s * MIC_RATE)
        t = np.arange(n) / MIC_RATE
        chunks.append(0.3 * np.sin(2 * np.pi * 220 * t) if kind == "tone" else np.zeros(n))
    sf.write(path, np.concatenate(chunks).astype(np.float32), MIC_RATE, subtype="PCM_16")
    return path


def send_text(page, text: str) -> None:
    page.fill("#text", text)
    page.click("#send")


SENTENCES = ["Here is a long answer for you.", *(f"This is sentence number {w} of it." for w in
             ("two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"))]


def long_reply() -> LlmReply:
    """About 8 s of fake speech; the first words come 1.5 s after the request (thinking)."""
    return LlmReply([Delta(SENTENCES[0], 1.5), *(Delta(" " + s, 0.05) for s in SENTENCES[1:])])


# ---- a spoken conversation on the real server over fake stages -----------------------------


def test_page_shows_partials_states_one_bubble_per_turn_barge_in_and_latency(tmp_path):
    """Two stretches of speech with a 0.9 s pause between them are one turn: one user bubble,
    live partials (committed + unstable) before its final, the reply to its first half gone
    without a trace; then thinking → assistant speaking with the output meter; a barge-in
    cuts the reply, which then shows only what was spoken, labelled; a typed turn's latency
    line has no ASR or voice→voice; Cancel is enabled only while a reply runs."""
    wav = mic_wav(tmp_path / "mic.wav", ("silence", 0.5), ("tone", 1.5), ("silence", 0.9), ("tone", 1.5),
                  ("silence", 14))
    llm = FakeLlm(default=long_reply())
    with launch(f"--use-file-for-fake-audio-capture={wav}%noloop") as b, \
            fake_server_thread(engines=fake_engines(llm=llm, tts=FakeTts(s_per_char=0.025))) as srv:
        page, errors = new_page(b, srv.http)
        s = screen(page)
        assert s["state"] == "mic off" and not s["cancelEnabled"] and s["banner"] is None and s["logOpen"]
        shots(page, "01-idle")

        page.click("#start")
        # a partial in the user's bubble while the turn goes on: words, the unstable tail apart
        s = until(page, "s.users.length === 1 && s.users[0].final === 'false' && /[a-z]/.test(s.users[0].text)",
                  "a partial transcript on screen")
        assert s["state"] == "you're speaking", s
        assert s["users"][0]["unstable"].strip(), s  # the first partial: nothing agreed yet
        assert s["micLevel"] > 0, s  # the input meter moves with the tone
        shots(page, "02-partial")
        # the pause ends the turn for a moment (its reply starts), the speech goes on: the same
        # bubble grows, committed words first
        s = until(page, "s.users.length >= 1 && s.users[0].final === 'false' && s.users[0].committed.trim() "
                  "&& s.users[0].unstable.trim()", "a partial with committed words and an unstable tail")
        wait(page, "window.voxpipe.events.some(e => e.type === 'response.cancelled' && e.reason === 'continued')",
             timeout_s=60, what="the speech to go on after the pause")
        # the merged turn's reply has started (its bubble is on screen; between transcript.final
        # and response.started the page is "thinking…" with no reply bubble yet)
        s = until(page, "s.state === 'thinking…' && s.users.every(u => u.final === 'true') && s.replies.length >= 1",
                  "thinking after the merged turn's end, its reply started")
        assert len(s["users"]) == 1 and s["users"][0]["final"] == "true", s
        words = s["users"][0]["text"].split()
        assert len(words) >= 8, s  # both stretches' words (a word per 256 ms of tone)
        # only the new reply's bubble (empty until its first words, 1.5 s after it starts): the
        # reply to the turn's first half is gone
        assert len(s["replies"]) == 1 and s["replies"][0]["text"] in ("", SENTENCES[0]), s
        assert s["cancelEnabled"], s
        first = page.evaluate("window.voxpipe.responses[1]")
        assert first["cancelled"] and first["reason"] == "continued" and first["spokenText"] == "", first
        shots(page, "03-thinking")

        s = until(page, "s.state === 'assistant speaking' && s.outActive", "the reply to be heard")
        assert s["cancelEnabled"] and len(s["replies"]) == 1 and s["replies"][0]["text"].startswith(SENTENCES[0])
        shots(page, "04-speaking")

        # barge-in: the microphone plays its file again (a new getUserMedia) over the reply
        page.click("#stop")
        page.click("#start")
        s = until(page, "s.replies.some(r => r.reason === 'barge_in')", "the reply cut by the barge-in")
        cut = next(r for r in s["replies"] if r["reason"] == "barge_in")
        r2 = page.evaluate("window.voxpipe.responses[2]")
        assert r2["cancelled"] and r2["reason"] == "barge_in", r2
        assert cut["text"] == r2["spokenText"].strip() + " …", (cut, r2)  # what was spoken, nothing more
        assert len(r2["spokenText"]) < len(" ".join(SENTENCES)), r2
        assert cut["meta"] == "interrupted: you spoke over it", cut
        wait(page, "window.voxpipe.responses[2].playedSamples > 0", timeout_s=30, what="reply 2's audio played")
        shots(page, "05-barge-in")

        # the barge-in turn's reply, with the spoken turn's latency line
        s = until(page, "s.replies.length >= 2 && /voice→voice/.test(s.replies[s.replies.length - 1].meta)",
                  "the reply to the barge-in turn", timeout_s=180)
        meta = s["replies"][-1]["meta"]
        assert "asr " in meta and "ttft " in meta and "first audio " in meta, meta
        until(page, "s.state === 'listening' && !s.cancelEnabled", "the reply to end", timeout_s=60)

        # a typed turn: latency from the moment it was sent, no ASR, no voice→voice
        llm.default = LlmReply.of("Hi there.")
        send_text(page, "Hello?")
        s = until(page, "s.replies.length >= 3 && /reply in \\d+ ms/.test(s.replies[s.replies.length - 1].meta)",
                  "the typed turn's reply")
        meta = s["replies"][-1]["meta"]
        assert "asr" not in meta and "voice→voice" not in meta and "ttft " in meta, meta
        s = until(page, "!s.cancelEnabled && s.state === 'listening'", "Cancel disabled after the reply")
        shots(page, "06-conversation")
        stats = page.evaluate("window.voxpipe.playback")
        assert stats["playedSamples"] > 0, stats
        assert_opus_both_ways(page)
        assert not errors, errors


def assert_opus_both_ways(page) -> dict:
    """The page talked Opus both ways (WebCodecs), as session.started confirms, and sent
    far fewer bytes per second of microphone audio than f32 (4 bytes a sample) or even
    PCM16 at 16 kHz (32 KB/s) would; returns the page's numbers."""
    keys = ["codec", "declared", "sampleRate", "samplesSent", "bytesSent", "bytesReceived", "audioFramesSent",
            "audioSamplesReceived"]
    vp = page.evaluate("(keys) => Object.fromEntries(keys.map(k => [k, window.voxpipe[k]]))", keys)
    started = page.evaluate("window.voxpipe.events.filter(e => e.type === 'session.started').pop()")
    assert vp["codec"] == "opus", vp
    assert vp["declared"]["format"] == "opus" and vp["declared"]["output_format"] == "opus", vp
    assert started["input"]["format"] == "opus" and started["output"]["format"] == "opus", started
    mic_s = vp["samplesSent"] / vp["sampleRate"]
    assert mic_s > 1 and vp["audioFramesSent"] >= mic_s * 45, vp  # 20 ms packets, one a message
    assert vp["bytesSent"] / mic_s < 6000, vp  # ~3 KB/s at 24 kb/s: f32 at 48 kHz is 192 KB/s
    reply_s = vp["audioSamplesReceived"] / vp["declared"]["output_sample_rate"]
    assert reply_s > 0 and vp["bytesReceived"] / reply_s < 8000, vp  # ~4 KB/s at 32 kb/s: PCM16 48 KB/s at 24 kHz
    return vp


# ---- reconnecting: server gone, warming up, a new session's replies ---------------------------


def test_page_reconnects_with_backoff_and_plays_the_new_sessions_reply():
    """The server stops: a banner says so with a countdown, the badge is not green, attempts
    back off (0.5 s doubling, ≤ 10 s, jittered); a new server on the same port: the page
    reconnects by itself, and the new session's reply #1 gets its own bubble and is heard
    (the old page appended it to the old #1 and dropped its audio)."""
    port = free_port()
    with launch() as b:
        with fake_server_thread(port=port) as srv:
            page, errors = new_page(b, srv.http)
            send_text(page, "one")
            until(page, "s.replies.length === 1 && /reply in/.test(s.replies[0].meta)", "the first reply")
            wait(page, "window.voxpipe.responses[1].playedSamples > 0", timeout_s=30, what="reply 1 heard")
        s = until(page, "s.banner && s.banner.kind === 'gone'", "the server-gone banner")
        assert s["connKey"] in ("closed", "connecting"), s  # never green meanwhile
        assert "The server is gone" in s["banner"]["text"], s
        s = until(page, "/Reconnecting in \\d+ s \\(attempt [2-9]\\)/.test(s.banner.text)", "a later attempt")
        shots(page, "07-server-gone")
        delays = wait(page, "window.voxpipe.reconnects.length >= 4 && window.voxpipe.reconnects", timeout_s=60,
                      what="four reconnection attempts")
        for d in delays:
            full = min(10_000, 500 * 2 ** (d["attempt"] - 1))
            assert 0.75 * full - 1 <= d["delayMs"] <= full, delays
        # the backoff's cap and jitter, from the page's own module
        capped = page.evaluate("import('/protocol.js').then(m => [m.backoffMs(20, 0, () => 0), "
                               "m.backoffMs(20, 0, () => 1), m.backoffMs(1, 7000, () => 1)])")
        assert capped == [10_000, 7_500, 7_000], capped

        with fake_server_thread(port=port):
            s = until(page, "s.conn.startsWith('connected') && s.banner === null", "the page to reconnect",
                      timeout_s=60)
            assert s["connKey"] == "open", s
            send_text(page, "two")
            s = until(page, "s.replies.length === 2 && /reply in/.test(s.replies[1].meta)", "the new session's reply")
            assert s["replies"][0]["text"] == s["replies"][1]["text"] == "Okay.", s  # not appended to the old one
            wait(page, "window.voxpipe.sessions === 2 && window.voxpipe.responses[1] && "
                 "window.voxpipe.responses[1].playedSamples > 0", timeout_s=30, what="the new reply heard")
            assert page.evaluate("window.voxpipe.audioFramesDropped") == 0
            shots(page, "08-reconnected")
        assert not [e for e in errors if "WebSocket" not in e and "ERR_CONNECTION_REFUSED" not in e], errors


def test_page_says_the_server_is_warming_up_and_connects_once_ready():
    with launch() as b, fake_server_thread() as srv:
        srv.app.ready = False
        page, errors = new_page(b, srv.http)
        send_text(page, "Hello?")
        s = until(page, "s.banner && s.banner.kind === 'not_ready' && /Trying again/.test(s.banner.text)",
                  "the warming-up banner")
        assert "warming up" in s["banner"]["text"] and s["conn"] == "server warming up", s
        assert s["connKey"] != "open", s
        shots(page, "09-warming-up")
        srv.app.ready = True
        until(page, "s.conn.startsWith('connected') && s.banner === null", "the page to connect", timeout_s=60)
        send_text(page, "Hello?")
        until(page, "s.replies.length === 1 && s.replies[0].text === 'Okay.'", "the reply once ready")
        assert not errors, errors


# ---- the microphone: denied, missing; typed turns without an AudioWorklet ------------------------


@pytest.mark.parametrize("case", ["denied", "no_mic"])
def test_page_explains_a_blocked_or_missing_microphone_and_typing_still_works(case):
    flags = {"denied": {"fake_ui": False}, "no_mic": {"fake_device": False}}[case]
    with launch(**flags) as b, fake_server_thread() as srv:
        page, _ = new_page(b, srv.http)
        page.click("#start")
        s = until(page, f"s.banner && s.banner.kind === '{case}'", "the microphone banner")
        want = {"denied": ("Microphone blocked", "connected · mic blocked"),
                "no_mic": ("No microphone found", "connected · no microphone")}[case]
        assert s["banner"]["text"].startswith(want[0]), s
        s = until(page, f"s.conn === '{want[1]}'", "the connection badge to say so")
        assert s["connKey"] == "warn" and s["state"] == "mic off" and s["startEnabled"], s  # not green
        send_text(page, "Hello?")
        until(page, "s.replies.length === 1 && s.replies[0].text === 'Okay.'", "a typed turn's reply")
        if case == "denied":
            shots(page, "10-mic-denied")


def test_typed_turns_work_without_an_audio_worklet(tmp_path):
    """A browser without AudioWorklet (an insecure origin, an old browser): typed turns are
    answered and heard, and the microphone falls back to a ScriptProcessor."""
    wav = mic_wav(tmp_path / "mic.wav", ("silence", 0.5), ("tone", 1.5), ("silence", 4))
    with launch(f"--use-file-for-fake-audio-capture={wav}%noloop") as b, fake_server_thread() as srv:
        ctx = b.new_context(viewport=DESKTOP)
        ctx.add_init_script("Object.defineProperty(BaseAudioContext.prototype, 'audioWorklet', "
                            "{get() { return undefined; }}); delete window.AudioWorkletNode;")
        page = ctx.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(srv.http + "/")
        assert page.evaluate("typeof AudioWorkletNode") == "undefined"
        send_text(page, "Hello?")
        until(page, "s.replies.length === 1 && s.replies[0].text === 'Okay.'", "the typed turn's reply")
        wait(page, "window.voxpipe.responses[1].playedSamples > 0", timeout_s=30, what="the reply heard")
        page.click("#start")
        s = until(page, "s.users.length === 2 && s.users[1].final === 'true'", "a spoken turn via ScriptProcessor")
        assert page.evaluate("window.voxpipe.micKind") == "script-processor"
        assert "alpha" in s["users"][1]["text"], s
        assert not errors, errors


# ---- settings ----------------------------------------------------------------------------------


def test_settings_are_kept_in_the_browser_and_sent_with_the_next_session(tmp_path):
    wav = mic_wav(tmp_path / "mic.wav", ("silence", 0.3), ("tone", 8.0), ("silence", 4))
    llm = FakeLlm()
    prompt = "You are a pirate. Answer in one short sentence."
    with launch(f"--use-file-for-fake-audio-capture={wav}%noloop") as b, \
            fake_server_thread(engines=fake_engines(llm=llm)) as srv:
        page, errors = new_page(b, srv.http)
        page.click("#settings-box summary")
        page.fill("textarea[name=system-prompt]", prompt)
        page.fill("input[name=language]", "EN")
        page.select_option("select[name=output-rate]", "24000")
        page.select_option("select[name=end-of-turn]", "smart-turn")
        page.select_option("select[name=eagerness]", "low")
        page.check("input[name=push-to-talk]")
        page.click("#settings-form button[type=submit]")
        assert page.inner_text("#settings-form .saved") == "saved"
        shots(page, "11-settings")

        page.reload()  # kept in the browser
        page.click("#settings-box summary")
        assert page.input_value("textarea[name=system-prompt]") == prompt
        assert page.input_value("input[name=language]") == "en"
        assert page.input_value("select[name=output-rate]") == "24000"
        assert page.is_checked("input[name=push-to-talk]")
        assert page.input_value("select[name=end-of-turn]") == "smart-turn"
        assert page.input_value("select[name=eagerness]") == "low"

        page.click("#start")
        s = until(page, "s.talkVisible && s.state === 'listening'", "the push-to-talk button")
        declared = page.evaluate("window.voxpipe.declared")
        assert declared["system_prompt"] == prompt and declared["language"] == "en", declared
        assert declared["vad"] is False and declared["output_sample_rate"] == 24000, declared
        assert declared["end_of_turn"] == "smart-turn" and declared["eagerness"] == "low", declared
        # Opus both ways by default; replies at 24 kHz (Chromium decodes at 48: counted at 24)
        assert declared["format"] == "opus" and declared["output_format"] == "opus", declared
        started = page.evaluate("window.voxpipe.events.find(e => e.type === 'session.started')")
        assert started["output"]["sample_rate"] == 24000
        assert started["end_of_turn"] == "input_end"  # push-to-talk: the button ends the turn
        page.wait_for_timeout(600)
        assert page.evaluate("window.voxpipe.samplesSent") == 0  # push-to-talk: nothing until held
        page.hover("#talk")
        page.mouse.down()
        until(page, "s.state === \"you're speaking\"", "the talking state while held", timeout_s=30)
        page.wait_for_timeout(2000)
        page.mouse.up()
        s = until(page, "s.replies.length === 1 && s.replies[0].meta !== ''", "the push-to-talk turn's reply")
        assert s["users"][0]["final"] == "true" and "alpha" in s["users"][0]["text"], s
        assert llm.requests[0].messages[0]["content"] == prompt  # the server used the saved prompt
        # the whole reply heard, counted at 24 kHz (Chromium decodes Opus at 48 kHz)
        wait(page, "(r => r.done && r.playedSamples === r.samples && r.samples > 0)(window.voxpipe.responses[1])",
             timeout_s=30, what="the whole reply heard")

        page.select_option("select[name=codec]", "pcm")  # PCM, at once on the open session
        page.click("#settings-form button[type=submit]")
        wait(page, "window.voxpipe.declared.format === 'f32' && !('output_format' in window.voxpipe.declared) && "
                   "window.voxpipe.codec === 'pcm' && window.voxpipe.events.filter(e => e.type === 'session.started')"
                   ".pop().output.format === 'pcm16'", timeout_s=30, what="PCM declared")
        page.click("#settings-form button[type=reset]")  # defaults, at once on the open session
        wait(page, "window.voxpipe.declared.system_prompt === undefined && !('vad' in window.voxpipe.declared)"
                   " && !('end_of_turn' in window.voxpipe.declared) && window.voxpipe.declared.format === 'opus'",
             timeout_s=30, what="the defaults re-declared")
        assert not until(page, "true", "the screen")["talkVisible"]
        assert not errors, errors


# ---- exact event sequences: cancelled replies, flush on resume, busy ---------------------------


def audio_frame(rid: int, seconds: float, rate: int) -> bytes:
    """A binary reply-audio frame: ``rid`` (u32 LE), then a quiet PCM16 tone."""
    t = np.arange(int(seconds * rate)) / rate
    return struct.pack("<I", rid) + (3000 * np.sin(2 * np.pi * 330 * t)).astype("<i2").tobytes()


def reply(rid: int, text: str, rate: int, *, audio_s: float = 3.0) -> list:
    return [server_event(ev.ResponseStarted, response_id=rid, user_text="x"),
            server_event(ev.ResponseTextDelta, response_id=rid, delta=text),
            audio_frame(rid, audio_s, rate)]


def test_cancelled_replies_show_only_what_was_spoken_and_a_resumed_user_stops_playback():
    rate = 24000  # the reply audio rate, chosen in the page's settings
    text = "Hello there. How are you today? I am fine."
    done = server_event(ev.ResponseDone, response_id=4, text="All said.", fallback=False, finish_reason="stop",
                        output_tokens=3, audio_s=3.0, timings_ms={"llm_ttft": 120.0, "first_audio": 300.0})
    turns = [
        [*reply(1, text, rate), server_event(ev.ResponseCancelled, response_id=1, spoken_text="Hello there.",
                                             reason="barge_in")],
        [*reply(2, text, rate), server_event(ev.ResponseCancelled, response_id=2, spoken_text="Hello there.",
                                             reason="new_turn")],
        [*reply(3, text, rate), server_event(ev.ResponseCancelled, response_id=3, spoken_text="", reason="error")],
        # a reply fully sent, then the user speaks while it still plays
        [*reply(4, "All said.", rate), done, server_event(ev.SpeechStarted, turn_id=5, audio_ms=9000)],
        [server_event(ev.Busy, turn_id=6, reason="queue", retry_after_ms=3000, message="a reply now would be late")],
    ]
    with launch() as b, scripted_server(turns=turns) as srv:
        page, errors = new_page(b, srv.http, init="localStorage.setItem('voxpipe.settings', "
                                f"JSON.stringify({{outputRate: '{rate}'}}))")
        for i, label in enumerate(["interrupted: you spoke over it", "replaced by your newer turn",
                                   "failed: the server had an error"]):
            send_text(page, f"turn {i + 1}")
            s = until(page, f"s.replies.length === {i + 1} && s.replies[{i}].cancelled", f"cancelled reply {i + 1}")
            assert s["replies"][i]["meta"] == label, s
        assert page.evaluate("window.voxpipe.declared.output_sample_rate") == rate
        s = screen(page)
        assert [r["text"] for r in s["replies"]] == ["Hello there. …", "Hello there. …",
                                                     "(stopped before it said anything)"], s
        assert all("How are you" not in r["text"] for r in s["replies"]), s
        shots(page, "12-cancelled")

        send_text(page, "turn 4")
        s = until(page, "s.replies.length === 4 && /stopped: you went on talking/.test(s.replies[3].meta)",
                  "playback stopped when the user spoke")
        assert s["state"] != "assistant speaking" and not s["outActive"], s
        assert page.evaluate("window.voxpipe.playback.flushes") >= 1
        assert page.evaluate("window.voxpipe.responses[4].playedSamples") == 0  # cut before its end

        send_text(page, "turn 5")
        s = until(page, "s.banner && s.banner.kind === 'busy' && /Try again in [1-3] s/.test(s.banner.text)",
                  "the busy banner's countdown")
        assert "The server is busy. The reply would miss the latency target." in s["banner"]["text"], s
        shots(page, "13-busy")
        until(page, "s.banner === null || /You can try again now/.test(s.banner.text)", "the countdown's end")
        assert not errors, errors


RATE_24K = 24000
PAUSED = server_event(ev.ResponsePaused, response_id=1, reason="speech")
CONTINUED = server_event(ev.ResponseCancelled, response_id=1, spoken_text="Sure,", reason="continued")
ALL_SENT = server_event(ev.ResponseDone, response_id=1, text="Sure.", fallback=False, finish_reason="stop",
                        output_tokens=2, audio_s=3.0, timings_ms={"llm_ttft": 120.0, "first_audio": 300.0})


@pytest.mark.parametrize("before, on_start, on_stop",
                         [([], [PAUSED], [CONTINUED]), ([ALL_SENT], [], []), ([ALL_SENT], [], [CONTINUED])],
                         ids=["cancelled", "all-sent", "all-sent-then-cut"])
def test_speech_that_continues_a_turn_under_a_new_id_joins_its_bubble(before, on_start, on_stop):
    # speech over the audible reply is a turn of its own (turn 3) until its words continue
    # turn 2: its final, the whole utterance, shows in turn 2's bubble. The reply is cancelled
    # (continued) — or it was all sent already (response.done, still playing) and the final's
    # continues_turn_id is the only sign (CI: JFK in two bubbles, "... Ask not." and the whole),
    # or it is cut after its response.done (the client still played it)
    whole = "I would like to book a table for two."
    over = [*before, server_event(ev.SpeechStarted, turn_id=3, audio_ms=3500), *on_start,
            server_event(ev.TranscriptPartial, turn_id=3, committed="", unstable="to book", text="to book",
                         language="en"),
            server_event(ev.SpeechStopped, turn_id=3, audio_ms=5000, reason="silence"), *on_stop]
    turns = [[server_event(ev.SpeechStarted, turn_id=2, audio_ms=1000),
              server_event(ev.SpeechStopped, turn_id=2, audio_ms=2500, reason="silence"),
              server_event(ev.TranscriptFinal, turn_id=2, text="I would like", language="en", audio_ms=1500),
              *reply(1, "Sure, what would you like?", RATE_24K), *over,
              server_event(ev.TranscriptFinal, turn_id=3, text=whole, language="en", audio_ms=4000,
                           continues_turn_id=2)]]
    with launch() as b, scripted_server(turns=turns) as srv:
        page, errors = new_page(b, srv.http)
        send_text(page, "go")
        s = until(page, "s.users.some(u => u.text === " + repr(whole) + ")", "the joined turn's transcript")
        spoken = [u for u in s["users"] if u["meta"].startswith("spoken")]
        assert [u["text"] for u in spoken] == [whole], s
        assert spoken[0]["final"] == "true", s
        assert not errors, errors


def test_page_falls_back_to_pcm_when_the_server_refuses_opus():
    """A server from before Opus answers the page's Opus session.start with bad_event (and no
    session.started): the page declares again in PCM (f32 in, PCM16 out), shows no error,
    streams f32 and plays the PCM16 reply."""
    rate = 24000
    done = server_event(ev.ResponseDone, response_id=1, text="Okay.", fallback=False, finish_reason="stop",
                        output_tokens=1, audio_s=1.0, timings_ms={"llm_ttft": 50.0, "first_audio": 100.0})
    with launch() as b, scripted_server(turn=[*reply(1, "Okay.", rate, audio_s=1.0), done], opus=False) as srv:
        page, errors = new_page(b, srv.http, init="localStorage.setItem('voxpipe.settings', "
                                f"JSON.stringify({{outputRate: '{rate}'}}))")
        page.click("#start")  # Chromium's fake microphone (a beep)
        s = until(page, "s.conn.startsWith('connected') && window.voxpipe.samplesSent > 0", "connected, audio sent")
        starts = [e for e in srv.received if e["type"] == "session.start"]
        assert [(e["format"], e.get("output_format")) for e in starts] == [("opus", "opus"), ("f32", None)], starts
        assert s["conn"].endswith("Hz f32") and s["banner"] is None, s
        send_text(page, "Hello?")
        until(page, "s.replies.length === 1 && /reply in/.test(s.replies[0].meta)", "the reply")
        wait(page, "window.voxpipe.responses[1].playedSamples > 0", timeout_s=30, what="the reply heard")
        vp = page.evaluate("window.voxpipe")
        assert vp["codec"] == "pcm", vp["codec"]
        assert vp["bytesSent"] == 4 * vp["samplesSent"] > 0, vp  # f32
        assert vp["responses"]["1"]["playedSamples"] == vp["responses"]["1"]["samples"] == rate, vp["responses"]
        assert vp["bytesReceived"] == 4 + 2 * rate, vp  # one PCM16 frame: response_id + 1 s
        assert not errors, errors


# ---- the whole thing, with real models and real speech (slow) ------------------------------------

CHATTY = "You are a chatty assistant. Answer every message with at least five long sentences."


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_spoken_conversation_with_real_models_barge_in_and_a_server_restart(tmp_path, audio_dir, manifest):
    """JFK as the microphone, the real server (SmolLM2, Whisper, Piper): partials on screen
    before the final, the reply heard, a barge-in cutting it, the server restarted on the same
    port and a reply of the new session heard. The page talks Opus both ways (WebCodecs,
    its default where the browser can): the transcript is of the Opus audio, the replies
    heard were decoded from Opus."""
    x, sr = sf.read(audio_dir / JFK, dtype="float32", always_2d=True)
    x = np.concatenate([np.zeros(sr // 2, np.float32), x.mean(axis=1), np.zeros(int(3.5 * sr), np.float32)])
    wav = tmp_path / "mic.wav"
    sf.write(wav, x, sr, subtype="PCM_16")
    port = free_port()
    with ExitStack() as stack:
        b = stack.enter_context(launch(f"--use-file-for-fake-audio-capture={wav}%noloop"))
        first = stack.enter_context(ExitStack())
        first.enter_context(running_server(tmp_path / "serve1.log", "--slo-ms", "60000", port=port))
        page, errors = new_page(b, f"http://127.0.0.1:{port}")
        page.click("#settings-box summary")
        page.fill("textarea[name=system-prompt]", CHATTY)
        page.click("#settings-form button[type=submit]")
        page.click("#settings-box summary")

        t0 = time.monotonic()
        page.click("#start")
        s = until(page, "s.users.length >= 1 && s.users[0].final === 'false' && /[a-z]/i.test(s.users[0].text)",
                  "a partial transcript on screen", timeout_s=300)
        assert not page.evaluate("window.voxpipe.events.some(e => e.type === 'transcript.final')")
        partial_s = time.monotonic() - t0
        shots(page, "real-01-partial")
        # the whole clip sent, its reply heard
        # (the reply may end before the clip's trailing silence is all sent: no wait on "speaking")
        s = until(page, f"window.voxpipe.samplesSent >= {len(x) / sr} * window.voxpipe.sampleRate && "
                  "s.users.every(u => u.final === 'true') && "
                  "Object.values(window.voxpipe.responses).some(r => r.playedSamples > 0)",
                  "the whole clip's transcript and its reply heard", timeout_s=300)
        final = s["users"][-1]["text"]
        ref = manifest[JFK]["reference_transcript"]
        merges = [ln for ln in (tmp_path / "serve1.log").read_text().splitlines() if "the latest turn (" in ln]
        bubbles = [u["text"] for u in s["users"]]
        why = "; ".join(ln.split("speech ", 1)[-1] for ln in merges)  # "continues … (0.64 s …, 0.92 s …)"
        assert len(bubbles) == 1, f"{len(bubbles)} bubbles {bubbles}: {why}"  # one bubble for the turn, pauses and all
        assert "ask not what your country" in final.lower() or wer(ref, final) <= 0.3, final
        opus = assert_opus_both_ways(page)  # ~3 KB/s sent, against f32's 192 KB/s at 48 kHz
        shots(page, "real-02-speaking")

        page.click("#stop")
        # a fresh reply to talk over (a typed question cuts the old one as "new_turn", not barge-in)
        n = page.evaluate("Object.keys(window.voxpipe.responses).length")
        send_text(page, "Tell me a long story about a ship at sea.")
        until(page, f"s.state === 'assistant speaking' && Object.keys(window.voxpipe.responses).length > {n}",
              "the typed question's reply heard", timeout_s=300)
        page.click("#start")  # JFK again, over the reply
        s = until(page, "s.replies.some(r => r.reason === 'barge_in')", "the barge-in", timeout_s=300)
        rid = page.evaluate("Object.entries(window.voxpipe.responses).find(([k, r]) => r.reason === 'barge_in')[0]")
        cut = page.evaluate(f"window.voxpipe.responses[{rid}]")
        assert cut["playedSamples"] > 0 and cut["spokenText"].strip(), cut
        assert next(r for r in s["replies"] if r["reason"] == "barge_in")["text"] == cut["spokenText"].strip() + " …"
        shots(page, "real-03-barge-in")
        page.click("#stop")

        first.close()  # the server stops ...
        s = until(page, "s.banner && s.banner.kind === 'gone'", "the server-gone banner", timeout_s=120)
        assert s["connKey"] in ("closed", "connecting"), s  # gone, and (a busy machine's poll late) retrying
        shots(page, "real-04-server-gone")
        # ... and a new one starts on the same port: the page reconnects by itself
        stack.enter_context(running_server(tmp_path / "serve2.log", "--slo-ms", "60000", port=port))
        until(page, "s.conn.startsWith('connected') && s.banner === null", "the page to reconnect", timeout_s=120)
        n = len(screen(page)["replies"])
        send_text(page, "What is the capital of France?")
        until(page, f"s.replies.length > {n} && /reply in/.test(s.replies[s.replies.length - 1].meta)",
              "the new session's reply", timeout_s=300)
        wait(page, "window.voxpipe.sessions === 2 && Object.values(window.voxpipe.responses).some(r => "
             "r.playedSamples > 0)", timeout_s=120, what="the new session's reply heard")
        shots(page, "real-05-after-restart")
        stats = page.evaluate("window.voxpipe.playback")
        mic_s = opus["samplesSent"] / opus["sampleRate"]
        reply_s = opus["audioSamplesReceived"] / opus["declared"]["output_sample_rate"]
        print(f"partial on screen {partial_s:.1f} s after Start; transcript {final!r}; playback {stats}; "
              f"Opus sent {opus['bytesSent'] / mic_s:.0f} B/s over {mic_s:.1f} s, received "
              f"{opus['bytesReceived'] / reply_s:.0f} B/s over {reply_s:.1f} s")
        assert page.evaluate("window.voxpipe.codec") == "opus"  # the new session too
        assert not [e for e in errors if "WebSocket" not in e and "ERR_CONNECTION_REFUSED" not in e], errors
