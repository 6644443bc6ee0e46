"""Degraded service in the command-line clients: ``voxpipe ask`` and ``voxpipe mic`` print
one line for each ``server.status`` (what is degraded and what that means, or "back to
normal"), mark a text-only reply (the TTS stage's circuit breaker was open), and explain the
``busy`` reasons ``ladder`` and ``breaker``. Against a scripted server on loopback
(tests/scripted_server.py): no model, no real server."""

from __future__ import annotations

import asyncio
import io
import json

import numpy as np
import pytest
import soundfile as sf

from cli.main import main
from clients.client import describe_busy, describe_status
from clients.mic import Console, _session
from pipeline.session import events as ev
from tests.scripted_server import scripted_server, server_event

LADDER = ev.Condition(source="ladder", stage="llm", level="2", effect="new turns refused")
TTS_OPEN = ev.Condition(source="breaker", stage="tts", level="open", effect="replies are text only")
SLO = ev.Condition(source="slo", stage=None, level="1", effect="shorter replies")
DEGRADED = server_event(ev.ServerStatus, degraded=True, conditions=[LADDER, TTS_OPEN])
NORMAL = server_event(ev.ServerStatus, degraded=False, conditions=[])
DEGRADED_LINE = ("degraded:   llm out-of-memory step 2 — new turns refused; "
                 "tts breaker open — replies are text only")


def text_only_reply(text: str = "Hi there.") -> list:
    """A reply without audio: the TTS stage's breaker was open."""
    return [server_event(ev.ResponseStarted, response_id=1, user_text="hello"),
            server_event(ev.ResponseTextDelta, response_id=1, delta=text),
            server_event(ev.ResponseDone, response_id=1, text=text, fallback=False, text_only=True,
                         finish_reason="stop", output_tokens=3, audio_s=0.0, timings_ms={})]


@pytest.fixture
def clip(tmp_path) -> str:
    """A short WAV to ask with (the scripted server ignores the audio)."""
    path = tmp_path / "q.wav"
    sf.write(path, (0.1 * np.sin(np.arange(3200) / 10)).astype(np.float32), 16000, subtype="PCM_16")
    return str(path)


def test_status_lines_name_each_condition_and_its_effect():
    assert describe_status(DEGRADED.model_dump(), column=12) == DEGRADED_LINE
    assert describe_status(NORMAL.model_dump(), column=12) == "service:    back to normal"
    slo = server_event(ev.ServerStatus, degraded=True,
                       conditions=[SLO, ev.Condition(source="breaker", stage="asr", level="half_open",
                                                     effect="spoken turns may be refused")])
    assert describe_status(slo.model_dump()) == ("degraded: latency over the SLO, level 1 — shorter replies; "
                                                 "asr breaker half-open — spoken turns may be refused")


def test_ladder_and_breaker_busy_are_explained():
    ladder = server_event(ev.Busy, reason="ladder", retry_after_ms=3000, message="llm ran out of memory twice")
    assert describe_busy(ladder.model_dump()) == ("server busy (ladder): a model ran out of memory: new turns are "
                                                  "refused while it recovers: llm ran out of memory twice")
    breaker = server_event(ev.Busy, reason="breaker", retry_after_ms=2000, message="asr is failing")
    assert describe_busy(breaker.model_dump()).startswith(
        "server busy (breaker): a processing stage is failing or too slow: its circuit breaker is open")


def test_ask_prints_the_degraded_line_and_a_text_only_reply(clip, tmp_path, monkeypatch, capsys):
    """A degraded server says so right after ``session.started``; the reply came as text only."""
    monkeypatch.chdir(tmp_path)
    with scripted_server(on_start=[DEGRADED], turn=text_only_reply()) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln for ln in out if ln.startswith(("degraded:", "service:"))] == [DEGRADED_LINE], out
    assert "voxpipe:    Hi there. (text only: speech unavailable)" in out, out
    assert not any(ln.startswith("reply audio") for ln in out), out  # no audio, no file
    assert not (tmp_path / "reply.wav").exists()


def test_ask_prints_back_to_normal_when_the_degradation_clears(clip, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    reply = [server_event(ev.ResponseStarted, response_id=1, user_text="hello"),
             server_event(ev.ResponseDone, response_id=1, text="Hello.", fallback=False, finish_reason="stop",
                          output_tokens=2, audio_s=0.0, timings_ms={})]
    with scripted_server(on_start=[DEGRADED], turn=[NORMAL, *reply]) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast", "--no-out"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln for ln in out if ln.startswith(("degraded:", "service:"))] == [DEGRADED_LINE,
                                                                              "service:    back to normal"], out
    assert "voxpipe:    Hello." in out  # an ordinary reply: no text-only mark


def test_ask_json_stays_one_object_with_a_status_in_between(clip, capsys):
    with scripted_server(on_start=[DEGRADED], turn=text_only_reply()) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast", "--json", "--no-out"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reply_text"] == "Hi there." and res["reply_audio_s"] == 0 and res["errors"] == []


def test_mic_prints_status_changes_and_marks_text_only_replies():
    out = io.StringIO()
    console = Console(out)
    console.status(DEGRADED.model_dump())
    console.reply(text_only_reply()[-1].model_dump())
    console.status(NORMAL.model_dump())
    console.reply({"type": "response.done", "text": "Hello.", "text_only": False})
    assert out.getvalue().splitlines() == [
        "voxpipe mic: degraded: llm out-of-memory step 2 — new turns refused; tts breaker open — replies are text only",
        "voxpipe: Hi there. (text only: speech unavailable)",
        "voxpipe mic: service: back to normal",
        "voxpipe: Hello.",
    ]


async def test_mic_session_reports_server_status_as_it_arrives(monkeypatch):
    """The mic client's own event loop: a ``server.status`` right after ``session.started``
    (and a later one) each get their line, a text-only reply its mark (no audio devices)."""
    import audio.devices
    from tests.fake_audio import FakeSoundDevice

    monkeypatch.setattr(audio.devices, "_sd", lambda: FakeSoundDevice())  # a silent room
    out = io.StringIO()
    with scripted_server(on_start=[DEGRADED, *text_only_reply(), NORMAL]) as srv:
        task = asyncio.create_task(_session(srv.url, None, None, Console(out), echo="off"))
        for _ in range(6000):  # until the last line (bounds a hang only: 60 s)
            if "back to normal" in out.getvalue() or task.done():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    said = [ln for ln in out.getvalue().splitlines() if not ln.startswith(("[", "voxpipe mic: echo:"))]  # no states
    assert said == [
        "listening — speak; Ctrl+C to quit",
        "voxpipe mic: degraded: llm out-of-memory step 2 — new turns refused; tts breaker open — replies are text only",
        "voxpipe: Hi there. (text only: speech unavailable)",
        "voxpipe mic: service: back to normal",
    ]
