"""The browser demo (web/) in a real headless Chromium against a real server.

Chromium's fake microphone plays a WAV file (the JFK clip with silence around it), the
page captures it with an AudioWorklet and streams it as Opus (WebCodecs; the reply audio
comes back as Opus too) at the AudioContext rate; the test
reads the page's state from ``window.voxpipe``. The ``busy`` tests (a refused turn, the
session cap) drive the page against a scripted server instead (tests/scripted_server.py:
no model, so not ``slow``).

Needs Debian's ``chromium`` (``apt-get install chromium``) and the ``playwright`` Python
package (no ``playwright install``: the system browser is used).
"""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from pipeline.session import events as ev
from tests.scripted_server import scripted_server, server_event
from tests.wsclient import wer

CHROMIUM = os.environ.get("VOXPIPE_CHROMIUM", "/usr/bin/chromium")
JFK = "en_jfk_inaugural_1961.wav"
LEAD_S, TAIL_S = 0.5, 3.5  # silence before and after the clip in the fake microphone
SCREENSHOT = "/tmp/voxpipe_web.png"

# Page-side helpers (evaluated in the browser).
LAST_RID = "Math.max(0, ...window.voxpipe.events.filter(e => e.type === 'response.started').map(e => e.response_id))"
REPLY_SETTLED = f"""(after) => {{
  const rid = {LAST_RID};
  const r = window.voxpipe.responses[rid];
  return rid > after && r && (r.done || r.cancelled) ? rid : null;
}}"""
REPLY_DONE = f"""() => {{
  const rid = {LAST_RID};
  const r = window.voxpipe.responses[rid];
  return r && r.done ? rid : null;
}}"""  # replies cancelled along the way (a turn the speaker went on with) are skipped


def fake_mic_wav(audio_dir: Path, out: Path) -> float:
    """Write the clip as 16-bit PCM mono with silence around it; returns its length (s)."""
    x, sr = sf.read(audio_dir / JFK, dtype="float32", always_2d=True)
    x = x.mean(axis=1)
    x = np.concatenate([np.zeros(int(LEAD_S * sr), np.float32), x, np.zeros(int(TAIL_S * sr), np.float32)])
    sf.write(out, x, sr, subtype="PCM_16")
    return len(x) / sr


@contextmanager
def launch(*extra_args: str, fake_ui: bool = True, fake_device: bool = True):
    """Headless Chromium (the system's), with a fake microphone (``fake_device``; False: the
    machine's own devices, none on a server) and no permission prompts (``fake_ui``: granted;
    False: a headless browser denies the microphone)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"Chromium not found at {CHROMIUM}: apt-get install chromium (or set VOXPIPE_CHROMIUM)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the playwright Python package is missing: pip install playwright")
    args = [
        "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--autoplay-policy=no-user-gesture-required",
        *(["--use-fake-ui-for-media-stream"] if fake_ui else []),
        *(["--use-fake-device-for-media-stream"] if fake_device else []), *extra_args,
    ]
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=args)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def browser(tmp_path, audio_dir):
    wav = tmp_path / "mic.wav"
    duration = fake_mic_wav(audio_dir, wav)
    with launch(f"--use-file-for-fake-audio-capture={wav}%noloop") as b:  # play once, then silence
        yield b, duration


def wait(page, expr: str, arg=None, timeout_s: float = 300, what: str = ""):
    """``page.wait_for_function`` with a failure message that shows the page's events.
    ``timeout_s`` only bounds a hang: generous, as a busy machine is slow."""
    from playwright.sync_api import TimeoutError as PwTimeout

    try:
        return page.wait_for_function(expr, arg=arg, timeout=timeout_s * 1000, polling=100).json_value()
    except PwTimeout:
        events = page.evaluate("window.voxpipe.events.filter(e => e.type !== 'response.text.delta')")
        pytest.fail(f"timed out after {timeout_s} s waiting for {what or expr}; events: {events}")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the generous waits below add up on a busy machine
def test_browser_voice_turn_text_turn_and_cancel(browser, server, manifest):
    b, mic_s = browser
    ctx = b.new_context(viewport={"width": 900, "height": 1000})
    ctx.set_default_timeout(120_000)  # page loads and clicks: 30 s by default, tight on a busy machine
    page = ctx.new_page()
    page_errors: list[str] = []
    page.on("pageerror", lambda e: page_errors.append(str(e)))
    page.on("console", lambda m: page_errors.append(f"{m.text} {m.location}") if m.type == "error" else None)
    page.on("response", lambda r: page_errors.append(f"HTTP {r.status} {r.url}") if r.status >= 400 else None)
    t0 = time.monotonic()
    page.goto(server["http"] + "/")
    assert page.title() == "voxpipe voice demo"

    # ---- spoken turn: Start, let the fake microphone play the clip, Stop ----
    page.click("#start")
    wait(page, "window.voxpipe.micActive", timeout_s=120, what="the microphone to start")
    vp = page.evaluate("window.voxpipe")
    rate = vp["sampleRate"]
    assert 8000 <= rate <= 48000
    assert vp["declared"] == {"type": "session.start", "sample_rate": rate, "format": "opus",
                              "output_format": "opus", "channels": 1, "output_sample_rate": rate}
    started = [e for e in vp["events"] if e["type"] == "session.started"][0]
    assert started["input"] == {"sample_rate": rate, "format": "opus", "channels": 1}
    assert started["output"] == {"sample_rate": rate, "format": "opus", "channels": 1}

    # The whole file (clip + trailing silence) has been captured and sent.
    wait(page, "(s) => window.voxpipe.samplesSent >= s * window.voxpipe.sampleRate", arg=mic_s,
         timeout_s=mic_s + 120, what="the fake microphone's audio to be sent")
    page.click("#stop")  # input.end: the turn is over (nothing should be pending by now)
    wait(page, "!window.voxpipe.micActive", timeout_s=60, what="the microphone to stop")
    rid = wait(page, REPLY_DONE, timeout_s=300, what="the reply to the spoken turn")

    vp = page.evaluate("window.voxpipe")
    kinds = [e["type"] for e in vp["events"]]
    assert "speech.started" in kinds and "speech.stopped" in kinds, kinds
    assert any(e["type"] == "input.end" for e in vp["sent"])
    # 20 ms messages: frames sent ≈ samples / (rate / 50)
    assert vp["audioFramesSent"] >= mic_s * 40, vp["audioFramesSent"]
    final = [e for e in vp["events"] if e["type"] == "transcript.final"][-1]["text"]
    ref = manifest[JFK]["reference_transcript"]
    assert "ask not what your country" in final.lower() or wer(ref, final) <= 0.3, final
    reply = vp["responses"][str(rid)]
    assert wer(ref, reply["userText"]) <= 0.3, reply["userText"]
    assert reply["text"].strip() and reply["text"] == reply["done"]["text"]
    assert reply["frames"] > 0 and reply["samples"] / rate >= 0.5, reply
    assert abs(reply["samples"] / rate - reply["done"]["audio_s"]) < 0.1  # Opus: the last 20 ms padded
    assert page.locator(".msg.assistant").last.locator(".text").inner_text().strip() == reply["text"].strip()
    assert "voice→voice" in page.locator(".msg.assistant").last.locator(".meta").inner_text()

    # ---- typed turn ----
    page.fill("#text", "Say hello in five words.")
    page.click("#send")
    rid2 = wait(page, REPLY_SETTLED, arg=rid, timeout_s=300, what="the reply to the typed turn")
    r2 = page.evaluate(f"window.voxpipe.responses[{rid2}]")
    assert r2["done"] and r2["text"].strip() and r2["userText"] == "Say hello in five words."
    assert r2["frames"] > 0

    # ---- cancel a reply while it is being written ----
    page.fill("#text", "Tell me a long story about a lighthouse keeper and the sea.")
    page.click("#send")
    rid3 = wait(page, f"""() => {{
        const rid = {LAST_RID};
        const r = window.voxpipe.responses[rid];
        return rid > {rid2} && r && (r.text || r.done) ? rid : null;
    }}""", timeout_s=300, what="the third reply to begin")
    page.click("#cancel")
    wait(page, REPLY_SETTLED, arg=rid2, timeout_s=120, what="the third reply to end")
    r3 = page.evaluate(f"window.voxpipe.responses[{rid3}]")
    if r3["done"] is None:  # not finished before the click: the server cancelled it
        assert r3["cancelled"]
        assert page.locator(".msg.assistant.cancelled").count() >= 1
    assert any(e["type"] == "response.cancel" for e in page.evaluate("window.voxpipe.sent"))
    page.wait_for_timeout(500)  # frames still in flight must be dropped, not played
    frames_after = page.evaluate(f"window.voxpipe.responses[{rid3}].frames")
    page.wait_for_timeout(1000)
    assert page.evaluate(f"window.voxpipe.responses[{rid3}].frames") == frames_after, "audio after cancel"

    vp = page.evaluate("window.voxpipe")
    errors = [e for e in vp["events"] if e["type"] == "error"]
    assert not errors, errors
    assert vp["status"].startswith("connected"), vp["status"]
    assert not page_errors, page_errors
    page.screenshot(path=SCREENSHOT, full_page=True)
    print(f"browser test took {time.monotonic() - t0:.1f} s; sample rate {rate}; transcript {final!r}; "
          f"playback underruns {vp['underruns']}")
    ctx.close()


# ---- busy: the page against a scripted server (tests/scripted_server.py; no model) ----------

BUSY_STATE = """() => {
  const el = [...document.querySelectorAll('#conversation .msg.busy')].pop();
  if (!el) return null;
  return {reason: el.dataset.reason, left: Number(el.dataset.left), text: el.querySelector('.text').innerText,
          countdown: el.querySelector('.countdown').innerText, meta: el.querySelector('.meta').innerText,
          retryOk: el.classList.contains('retry-ok'), count: document.querySelectorAll('.msg.busy').length};
}"""


def open_page(b, http: str, path: str = "/"):
    """A fresh page on ``http`` + ``path``; returns it with the list its uncaught JS errors go to."""
    ctx = b.new_context(viewport={"width": 900, "height": 1000})
    ctx.set_default_timeout(120_000)
    page = ctx.new_page()
    js_errors: list[str] = []
    page.on("pageerror", lambda e: js_errors.append(str(e)))
    page.goto(http + path)
    return page, js_errors


def busy_state(page, cond: str, what: str, timeout_s: float = 60) -> dict:
    """Wait until the newest busy bubble satisfies ``cond`` (JS, on its state ``s``)."""
    return wait(page, f"() => {{ const s = ({BUSY_STATE})(); return s && ({cond}) ? s : null; }}",
                timeout_s=timeout_s, what=what)


def test_browser_shows_busy_with_its_reason_and_a_countdown_to_retry():
    message = "a reply now would take ~9100 ms, over the 2000 ms SLO"
    busy = server_event(ev.Busy, reason="queue", retry_after_ms=5000, message=message)
    with launch() as b, scripted_server(turn=[busy]) as srv:
        page, js_errors = open_page(b, srv.http)
        page.fill("#text", "Hello?")
        page.click("#send")
        # a bubble in the conversation (not only the event log), with a countdown running
        s = busy_state(page, "s.left > 0", "the busy bubble with a countdown")
        assert s["reason"] == "queue" and s["count"] == 1
        assert s["text"] == "Server busy (queue): the reply would miss the latency target", s
        assert s["meta"] == message
        first = s["left"]
        assert 1 <= first <= 5 and s["countdown"] == f"retry in {first} s", s
        # it ticks down ...
        s = busy_state(page, f"s.left > 0 && s.left < {first}", "the countdown to go down")
        assert re.fullmatch(r"retry in [1-4] s", s["countdown"]), s
        # ... to zero, then says a retry may succeed
        s = busy_state(page, "s.left === 0", "the countdown to end")
        assert s["countdown"] == "you can try again now" and s["retryOk"], s
        vp = page.evaluate("window.voxpipe")
        assert vp["busy"] == [{"reason": "queue", "retry_after_ms": 5000, "message": message}]
        assert [e["type"] for e in vp["events"]] == ["session.started", "busy"]
        assert vp["status"].startswith("connected")  # a refused turn leaves the session open
        assert "busy (queue)" in page.inner_text("#log")
        assert [e["type"] for e in srv.received] == ["session.start", "text.input"]
        assert not js_errors, js_errors


@pytest.mark.parametrize("refuse", ["http", "close"])
def test_browser_shows_the_session_cap_as_busy_sessions(refuse):
    """The session cap: HTTP 503 before the upgrade (the page learns it over HTTP: a
    browser's WebSocket only reports 1006), or close code 1013 right after it."""
    with launch() as b, scripted_server(refuse=refuse, retry_after_s=7, max_sessions=2) as srv:
        page, js_errors = open_page(b, srv.http)
        page.fill("#text", "Hello?")
        page.click("#send")
        s = busy_state(page, "s.left > 0", "the busy bubble for the session cap")
        assert s["reason"] == "sessions"
        assert s["text"] == "Server busy (sessions): too many sessions are open", s
        assert "server full: 2 sessions" in s["meta"], s
        assert 1 <= s["left"] <= (7 if refuse == "http" else 5) and s["countdown"] == f"retry in {s['left']} s"
        busy = page.evaluate("window.voxpipe.busy")
        assert [x["retry_after_ms"] for x in busy] == [7000 if refuse == "http" else 5000], busy
        wait(page, "window.voxpipe.status === 'busy (sessions)'", timeout_s=60, what="the status badge")
        assert page.evaluate("window.voxpipe.events") == []  # no session, no events
        assert not js_errors, js_errors


# ---- degraded service: server.status, busy ladder/breaker, text-only replies (scripted) -----

LADDER = ev.Condition(source="ladder", stage="llm", level="2", effect="new turns are refused for a moment")
TTS_OPEN = ev.Condition(source="breaker", stage="tts", level="open", effect="replies are text only")
DEGRADED_STATE = """() => {
  const badge = document.getElementById('degraded'), line = document.getElementById('degraded-effects');
  return {badge: !badge.hidden && badge.offsetParent !== null, title: badge.title, badgeText: badge.innerText,
          line: line.hidden ? null : line.innerText, degraded: window.voxpipe.degraded,
          statuses: window.voxpipe.events.filter(e => e.type === 'server.status').length};
}"""


def degraded_state(page, cond: str, what: str, timeout_s: float = 60) -> dict:
    """Wait until the page's degraded-service state ``s`` satisfies ``cond`` (JS)."""
    return wait(page, f"() => {{ const s = ({DEGRADED_STATE})(); return ({cond}) ? s : null; }}",
                timeout_s=timeout_s, what=what)


def send_text(page, text: str) -> None:
    page.fill("#text", text)
    page.click("#send")


def test_browser_shows_a_degraded_badge_while_the_server_is_degraded():
    """Right after session.started (a degraded server says so at once), then on each change
    of conditions; ``degraded: false`` hides it again."""
    one = server_event(ev.ServerStatus, degraded=True, conditions=[LADDER])
    two = server_event(ev.ServerStatus, degraded=True, conditions=[LADDER, TTS_OPEN])
    normal = server_event(ev.ServerStatus, degraded=False, conditions=[])
    with launch() as b, scripted_server(on_start=[one], turns=[[], [two], [normal]]) as srv:
        page, js_errors = open_page(b, srv.http)
        s = page.evaluate(f"({DEGRADED_STATE})()")
        assert not s["badge"] and s["line"] is None and s["degraded"] == []  # normal until told otherwise
        send_text(page, "one")
        s = degraded_state(page, "s.statuses === 1 && s.badge", "the degraded badge after session.started")
        assert s["badgeText"] == "degraded"
        assert s["line"] == "Degraded service: new turns are refused for a moment", s
        assert s["title"] == "llm out-of-memory step 2: new turns are refused for a moment", s
        assert s["degraded"] == [LADDER.model_dump()]
        send_text(page, "two")
        s = degraded_state(page, "s.statuses === 2", "the second server.status")
        assert s["badge"] and s["line"] == ("Degraded service: new turns are refused for a moment; "
                                            "replies are text only"), s
        assert s["title"].splitlines() == ["llm out-of-memory step 2: new turns are refused for a moment",
                                           "tts breaker open: replies are text only"], s
        assert s["degraded"] == [LADDER.model_dump(), TTS_OPEN.model_dump()]
        send_text(page, "three")
        s = degraded_state(page, "s.statuses === 3", "the server.status back to normal")
        assert not s["badge"] and s["line"] is None and s["degraded"] == [] and s["title"] == "", s
        assert "server.status: back to normal" in page.inner_text("#log")
        assert page.evaluate("window.voxpipe.status").startswith("connected")
        assert not js_errors, js_errors


def test_browser_explains_ladder_and_breaker_busy_and_marks_a_text_only_reply():
    ladder = server_event(ev.Busy, reason="ladder", retry_after_ms=3000, message="llm ran out of memory twice")
    breaker = server_event(ev.Busy, reason="breaker", retry_after_ms=2000, message="asr circuit breaker is open")
    reply = [server_event(ev.ResponseStarted, response_id=1, user_text="three"),
             server_event(ev.ResponseTextDelta, response_id=1, delta="Hi there."),
             server_event(ev.ResponseDone, response_id=1, text="Hi there.", fallback=False, text_only=True,
                          finish_reason="stop", output_tokens=3, audio_s=0.0, timings_ms={})]
    with launch() as b, scripted_server(turns=[[ladder], [breaker], reply]) as srv:
        page, js_errors = open_page(b, srv.http)
        send_text(page, "one")
        s = busy_state(page, "s.reason === 'ladder'", "the ladder busy bubble")
        assert s["text"] == "Server busy (ladder): a model ran out of memory: new turns are refused while it recovers"
        assert s["meta"] == "llm ran out of memory twice"
        send_text(page, "two")
        s = busy_state(page, "s.reason === 'breaker'", "the breaker busy bubble")
        assert s["text"] == ("Server busy (breaker): a processing stage is failing or too slow: "
                             "its circuit breaker is open"), s
        send_text(page, "three")
        wait(page, "window.voxpipe.responses[1] && window.voxpipe.responses[1].done", timeout_s=60,
             what="the text-only reply")
        last = page.locator(".msg.assistant").last
        assert last.locator(".text").inner_text() == "Hi there."
        assert last.locator(".note").inner_text() == "text only (speech unavailable)"
        assert "text-only" in (last.get_attribute("class") or "")
        # replies with speech carry no such note
        assert page.locator(".msg .note").count() == 1
        assert not js_errors, js_errors


# ---- the edge: the token from the page's URL; a foreign page cannot connect ----------------

WS_PROBE = """(url) => new Promise((resolve) => {
  const ws = new WebSocket(url);
  ws.onopen = () => { ws.close(); resolve("open"); };
  ws.onclose = (e) => resolve(`closed ${e.code}`);
})"""


def test_browser_passes_the_token_from_its_url_and_a_foreign_page_cannot_connect():
    """The real server's edge (fake stages): the page opened as ``/?token=...`` connects and
    is answered; opened without it, it says a token is needed; a page of another origin
    (the scripted server, another port) cannot open the server's WebSocket at all."""
    from pipeline.config import ServerConfig, VoxpipeConfig
    from tests.fake_server import fake_server_thread

    token = "page-token"
    cfg = VoxpipeConfig(server=ServerConfig(token=token))
    with launch() as b, fake_server_thread(cfg) as srv, scripted_server() as other:
        page, js_errors = open_page(b, srv.http, f"/?token={token}")
        send_text(page, "Hello?")
        wait(page, "window.voxpipe.events.some(e => e.type === 'response.done')", timeout_s=60,
             what="the reply over the token-protected socket")
        assert page.evaluate("window.voxpipe.refused") is None and not js_errors, js_errors

        page, _ = open_page(b, srv.http)  # no token
        send_text(page, "Hello?")
        refused = wait(page, "window.voxpipe.refused", timeout_s=60, what="the page to say why it was refused")
        assert refused["status"] == 401 and "token is required" in refused["message"]
        wait(page, "window.voxpipe.status === 'refused: token needed'", timeout_s=30, what="the status badge")
        assert page.evaluate("window.voxpipe.events") == []

        page, _ = open_page(b, other.http)  # a page of another origin, token and all
        assert page.evaluate(WS_PROBE, f"{srv.ws}?token={token}") == "closed 1006"
        assert page.evaluate(WS_PROBE, other.url) == "open"  # the probe itself works
