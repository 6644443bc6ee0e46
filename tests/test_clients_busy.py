"""``busy`` in the command-line clients: ``voxpipe ask`` and ``voxpipe mic`` say why the
server refused (the reason in plain words and its message) and when to try again, for a
refused turn (a ``busy`` event) and a refused session (HTTP 503 / close 1013). Against a
scripted server on loopback (tests/scripted_server.py): no model, no real server."""

from __future__ import annotations

import asyncio
import io
import json
import re

import numpy as np
import pytest
import soundfile as sf

from cli.main import main
from clients.client import BUSY_REASONS, SESSIONS_RETRY_MS, describe_busy, sessions_busy
from clients.mic import EXIT_BUSY, Console, run_mic
from pipeline.errors import BusyReason
from pipeline.session import events as ev
from tests.scripted_server import scripted_server, server_event

SLO_MESSAGE = "a reply now would take ~3262 ms, over the 2000 ms SLO"
QUEUE_BUSY = server_event(ev.Busy, reason="queue", retry_after_ms=1300, message=SLO_MESSAGE)
DEADLINE_S = 60.0  # bounds a hang only


@pytest.fixture
def clip(tmp_path) -> str:
    """A short WAV to ask with (the scripted server ignores the audio)."""
    path = tmp_path / "q.wav"
    sf.write(path, (0.1 * np.sin(np.arange(3200) / 10)).astype(np.float32), 16000, subtype="PCM_16")
    return str(path)


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_every_busy_reason_has_plain_words():
    from typing import get_args

    assert set(BUSY_REASONS) == set(get_args(BusyReason))
    line = describe_busy(QUEUE_BUSY.model_dump())
    assert line == ("server busy (queue): the reply would miss the latency target: "
                    "a reply now would take ~3262 ms, over the 2000 ms SLO")


@pytest.mark.parametrize(("retry_after", "ms"), [("7", 7000), ("1.5", 1500), (None, SESSIONS_RETRY_MS),
                                                 ("Wed, 21 Oct 2015 07:28:00 GMT", SESSIONS_RETRY_MS)])
def test_a_refused_session_reads_retry_after_seconds(retry_after, ms):
    busy = sessions_busy("server full: 4 sessions (--max-sessions)\n", retry_after)
    assert busy == {"reason": "sessions", "retry_after_ms": ms, "message": "server full: 4 sessions (--max-sessions)"}


# ---- voxpipe ask ---------------------------------------------------------------------------


def test_ask_prints_a_refused_turn_with_reason_message_and_retry(clip, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with scripted_server(turn=[server_event(ev.SpeechStopped, audio_ms=200, reason="input_end"), QUEUE_BUSY]) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast"]) == 0
    out = capsys.readouterr().out
    assert "voxpipe:    (no reply)" in out
    busy_line = [ln for ln in out.splitlines() if ln.startswith("busy:")]
    assert busy_line == ["busy:       server busy (queue): the reply would miss the latency target: "
                         "a reply now would take ~3262 ms, over the 2000 ms SLO; try again in 1.3 s"], out
    assert not (tmp_path / "reply.wav").exists()  # no reply, no file


def test_ask_json_carries_the_busy_event(clip, capsys):
    with scripted_server(turn=[QUEUE_BUSY]) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast", "--json", "--no-out"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["busy"] == {"reason": "queue", "retry_after_ms": 1300, "message": SLO_MESSAGE}
    assert res["reply_text"] == "" and res["errors"] == []


def test_ask_reports_a_failed_reply_at_once_as_one_json_object(clip, capsys):
    """A reply that fails (its LLM replica died: ``error`` then ``response.cancelled`` reason
    ``error``) ends ``ask`` at once with the error, not after its reply timeout."""
    failed = [server_event(ev.ResponseStarted, response_id=1, user_text="Go forward."),
              server_event(ev.Error, code="reply_failed", message="llm deployment: its replica died"),
              server_event(ev.ResponseCancelled, response_id=1, reason="error", spoken_text="")]
    with scripted_server(turn=failed) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast", "--json", "--no-out", "--timeout", "120"]) == 1
    res = json.loads(capsys.readouterr().out)
    assert [e["code"] for e in res["errors"]] == ["reply_failed"] and res["reply_text"] == ""


@pytest.mark.parametrize("refuse", ["http", "close"])
def test_ask_reports_the_session_cap_as_busy_sessions(clip, refuse, capsys):
    with scripted_server(refuse=refuse, retry_after_s=7, max_sessions=3) as srv:
        assert main(["ask", clip, "--url", srv.url, "--fast", "--json", "--no-out"]) == 0
    captured = capsys.readouterr()
    res = json.loads(captured.out)
    busy = res["busy"]
    assert busy["reason"] == "sessions" and "server full: 3 sessions" in busy["message"], busy
    # HTTP 503 carries Retry-After (7 s); a close frame has no room for one: the server's usual 5 s
    assert busy["retry_after_ms"] == (7000 if refuse == "http" else SESSIONS_RETRY_MS)
    assert captured.err == ""


# ---- voxpipe mic ---------------------------------------------------------------------------


def test_mic_busy_off_a_terminal_is_one_line():
    out = io.StringIO()
    Console(out).busy(QUEUE_BUSY.model_dump())
    assert out.getvalue() == ("voxpipe mic: server busy (queue): the reply would miss the latency target: "
                              "a reply now would take ~3262 ms, over the 2000 ms SLO; try again in 1.3 s\n")


async def test_mic_busy_on_a_terminal_counts_down_to_zero():
    out = Tty()
    console = Console(out)
    console.busy({"reason": "memory", "retry_after_ms": 2500, "message": "the LLM's KV budget is full"})
    task = console._countdown
    assert task is not None
    await asyncio.wait_for(task, DEADLINE_S)
    first, rest = out.getvalue().split("\n", 1)
    assert first == ("voxpipe mic: server busy (memory): the language model's memory is full: "
                     "the LLM's KV budget is full")
    left = [int(n) for n in re.findall(r"\r  retry in (\d+) s ", rest)]
    assert left and left[0] <= 3 and left == sorted(left, reverse=True) and min(left) >= 1, rest
    assert rest.endswith("\r  you can try again now\n")


async def test_mic_countdown_gives_way_to_the_next_message():
    out = Tty()
    console = Console(out)
    console.busy({"reason": "stage", "retry_after_ms": 600_000, "message": "asr is busy"})
    task = console._countdown
    for _ in range(int(DEADLINE_S / 0.01)):  # until the countdown has written its first line
        if "retry in" in out.getvalue():
            break
        await asyncio.sleep(0.01)
    console.say("you: hello")
    await asyncio.gather(task, return_exceptions=True)
    assert task is not None and task.cancelled()
    assert out.getvalue().endswith("\r  retry in 600 s \nyou: hello\n"), repr(out.getvalue())


def test_mic_refused_session_says_busy_sessions_and_exits(capsys):
    with scripted_server(refuse="http", retry_after_s=7, max_sessions=2) as srv:
        assert run_mic(srv.url) == EXIT_BUSY
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["voxpipe mic: server busy (sessions): too many sessions are open: "
                   "server full: 2 sessions (--max-sessions); try again in 7.0 s"]
