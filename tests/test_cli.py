"""The ``voxpipe`` command line as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
                        "errors"}
    assert res["turn_empty"] is None and res["busy"] is None and res["errors"] == []
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
def test_ask_music_has_no_reply(server, audio_dir, tmp_path):
    r = voxpipe("ask", str(audio_dir / "xx_hard_music_brahms_hungarian_dance5_30s.wav"), "--url", server["url"],
                "--json", "--fast", "--out", str(tmp_path / "r.wav"))
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert res["transcript"] == "" and res["reply_text"] == "" and res["reply_audio_s"] == 0
    assert res["turn_empty"] in ("no_speech", "no_words")  # says why there is no reply


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


def test_runtime_env_bounds_onednn_cache_but_user_setting_wins(monkeypatch):
    from cli.main import _runtime_env

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    _runtime_env()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "256"
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
