"""The ``voxpipe`` command line as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import ROOT, free_port
from tests.wsclient import wer

JFK = "en_jfk_inaugural_1961.wav"


def voxpipe(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m cli ARGS``; ``timeout`` only bounds a hang (generous: a busy machine
    imports torch and runs the models slowly)."""
    return subprocess.run([sys.executable, "-m", "cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_ask_json_prints_one_object_and_writes_audio(server, audio_dir, manifest, tmp_path):
    out = tmp_path / "reply.wav"
    r = voxpipe("ask", str(audio_dir / JFK), "--url", server["url"], "--json", "--out", str(out))
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert set(res) == {"transcript", "reply_text", "reply_audio_s", "timings_ms", "partials", "turn_empty", "busy",
                        "errors", "text_only", "status", "bytes", "language", "voice"}
    assert res["language"] == "en" and res["voice"] == "joe"  # the English-only ASR, the default voice
    assert res["turn_empty"] is None and res["busy"] is None and res["errors"] == []
    assert res["text_only"] is False and res["status"] is None  # a healthy server sends no server.status
    partials = res["partials"]  # live partial transcripts of the 11 s clip, in order
    assert len(partials) >= 3 and all(set(p) == {"t_ms", "text"} for p in partials)
    assert [p["t_ms"] for p in partials] == sorted(p["t_ms"] for p in partials)
    # live: the partials grow as the clip is heard (when the first one arrives depends on
    # the machine's speed, so no bound on its time)
    assert len({p["text"] for p in partials}) >= 2, partials
    assert "fellow" in " ".join(p["text"] for p in partials).lower()
    assert wer(manifest[JFK]["reference_transcript"], res["transcript"]) <= 0.15
    assert res["reply_text"] and res["reply_audio_s"] >= 0.5
    t = res["timings_ms"]
    assert set(t) >= {"asr_final", "llm_ttft", "first_audio", "voice_to_voice"}
    assert all(isinstance(t[k], (int, float)) and t[k] > 0
               for k in ("asr_final", "llm_ttft", "first_audio", "voice_to_voice"))
    assert t["voice_to_voice"] >= t["asr_final"]
    import soundfile as sf

    info = sf.info(str(out))
    assert abs(info.duration - res["reply_audio_s"]) < 0.05


@pytest.mark.slow
def test_ask_in_opus_gets_its_reply_for_a_tenth_of_the_bytes(server, audio_dir, tmp_path):
    clip = audio_dir / "en_cmu_goforward.wav"
    out = tmp_path / "reply.wav"
    r = voxpipe("ask", str(clip), "--url", server["url"], "--json", "--codec", "opus", "--out", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert "forward" in res["transcript"].lower() and res["errors"] == [], res
    assert res["reply_audio_s"] >= 0.5
    import soundfile as sf

    info = sf.info(str(clip))
    pcm_up, pcm_down = info.duration * 16000 * 2, res["reply_audio_s"] * 24000 * 2  # PCM16 at 16 and 24 kHz
    assert 0 < res["bytes"]["sent"] <= pcm_up / 8 and 0 < res["bytes"]["reply"] <= pcm_down / 8, res["bytes"]
    assert res["bytes"]["received"] >= res["bytes"]["reply"]
    assert abs(sf.info(str(out)).duration - res["reply_audio_s"]) < 0.05


@pytest.mark.slow
def test_ask_music_has_no_reply(server, audio_dir, tmp_path):
    r = voxpipe("ask", str(audio_dir / "xx_hard_music_brahms_hungarian_dance5_30s.wav"), "--url", server["url"],
                "--json", "--fast", "--out", str(tmp_path / "r.wav"))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["transcript"] == "" and res["reply_text"] == "" and res["reply_audio_s"] == 0
    assert res["turn_empty"] in ("no_speech", "no_words")  # says why there is no reply


def _scripted_reply(audio_s: float = 0.5, rate: int = 24000) -> list:
    """A scripted server's answer to a turn: a reply with ``audio_s`` of audio."""
    from audio.frames import audio_frame
    from pipeline.session import events as ev
    from tests.scripted_server import server_event

    pcm = (np.sin(np.arange(int(audio_s * rate)) / 8) * 3000).astype("<i2").tobytes()
    return [server_event(ev.ResponseStarted, response_id=1, user_text="hello"), audio_frame(1, pcm),
            server_event(ev.ResponseDone, response_id=1, text="Hi there.", fallback=False, finish_reason="stop",
                         output_tokens=3, audio_s=audio_s, timings_ms={})]


@pytest.mark.parametrize("out", ["default", "--out", "--no-out"])
def test_ask_writes_reply_audio_where_asked(out, tmp_path, monkeypatch, capsys):
    """``reply.wav`` in the current folder unless ``--out PATH`` says where or ``--no-out``
    says nowhere (docs/CLIENTS.md: "writes reply.wav"). A scripted server: no model."""
    import soundfile as sf

    from cli.main import main
    from tests.scripted_server import scripted_server

    clip = tmp_path / "q.wav"
    sf.write(clip, np.zeros(1600, np.float32), 16000, subtype="PCM_16")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    args = {"default": [], "--out": ["--out", str(tmp_path / "r.wav")], "--no-out": ["--no-out"]}[out]
    with scripted_server(turn=_scripted_reply(0.5)) as srv:
        assert main(["ask", str(clip), "--url", srv.url, "--fast", *args]) == 0
    stdout = capsys.readouterr().out
    assert "voxpipe:    Hi there." in stdout
    written = {"default": cwd / "reply.wav", "--out": tmp_path / "r.wav", "--no-out": None}[out]
    assert sorted(p.name for p in cwd.iterdir()) == (["reply.wav"] if out == "default" else [])
    if written is None:
        assert not (tmp_path / "r.wav").exists() and "reply audio 0.50 s (not saved: --no-out)" in stdout
    else:
        assert f"reply audio 0.50 s -> {written if out == '--out' else 'reply.wav'}" in stdout
        assert abs(sf.info(str(written)).duration - 0.5) < 0.01


def test_ask_without_server_says_so_in_one_line(audio_dir):
    r = voxpipe("ask", str(audio_dir / JFK), "--url", f"ws://127.0.0.1:{free_port()}/ws", "--json", timeout=300)
    assert r.returncode != 0
    assert r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and "no voxpipe server" in r.stderr


def test_mic_without_server_says_so(tmp_path):
    r = voxpipe("mic", "--url", f"ws://127.0.0.1:{free_port()}/ws", timeout=300)
    assert r.returncode != 0 and "no voxpipe server" in r.stderr


def test_serve_rejects_bad_config():
    r = voxpipe("serve", "--llm-threads", "0", timeout=300)
    assert r.returncode == 2 and "llm.threads" in r.stderr


@pytest.mark.parametrize("flags, says", [
    (("--llm", "nosuch"), "--llm 'nosuch'"),
    (("--device", "nosuch"), "--device 'nosuch'"),
    (("--asr-model", "nosuch"), "unknown ASR model 'nosuch'"),
])
def test_serve_names_a_misspelt_model_or_device_in_one_line(flags, says):
    """A typo is a one-line error and exit 2 (the ASR model's is found when it loads, first)."""
    r = voxpipe("serve", "--port", str(free_port()), *flags, timeout=300)
    assert r.returncode == 2 and says in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("voxpipe: ")]
    assert "Traceback" not in r.stderr and len(errors) == 1 and says in errors[0], r.stderr


def test_runtime_env_bounds_onednn_cache_but_user_setting_wins(monkeypatch):
    from cli.serve import runtime_env as _runtime_env

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _runtime_env()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["GOMP_SPINCOUNT"] == "10000"


def test_ask_and_mic_pass_the_token_and_say_in_one_line_when_it_is_missing(audio_dir):
    """Against the real server's edge (fake stages, in this process) with ``--token``: both
    clients refused without it (exit 6, one line, no traceback); ``ask`` with the token (from
    ``VOXPIPE_TOKEN``) is answered, ``mic`` with it gets past the handshake to the audio
    devices (none by that name: exit 2, one line)."""
    from pipeline.config import ServerConfig, VoxpipeConfig
    from tests.fake_server import fake_server_thread

    with fake_server_thread(VoxpipeConfig(server=ServerConfig(token="cli-token"))) as srv:
        for cmd in (["ask", str(audio_dir / "en_cmu_goforward.wav"), "--fast", "--no-out"], ["mic"]):
            r = voxpipe(*cmd, "--url", srv.ws, timeout=300)
            assert r.returncode == 6, r.stderr
            line = r.stderr.strip()
            assert "\n" not in line and "HTTP 401" in line and "--token or set VOXPIPE_TOKEN" in line, line
        r = subprocess.run([sys.executable, "-m", "cli", "ask", str(audio_dir / "en_cmu_goforward.wav"), "--fast",
                            "--no-out", "--json", "--url", srv.ws], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env=dict(os.environ, VOXPIPE_TOKEN="cli-token"))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["reply_text"]
        r = voxpipe("mic", "--url", srv.ws, "--token", "cli-token", "--input-device", "no-such-device", timeout=300)
        assert r.returncode == 2 and "HTTP 401" not in r.stderr and "Traceback" not in r.stderr, r.stderr
