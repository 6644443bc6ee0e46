"""Cold start: ready only after warm-up; the first turn costs about what the later ones do."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from audio.pcm import resample
from audio.wav import read_mono
from tests.conftest import ROOT, free_port
from tests.wsclient import Client

pytestmark = pytest.mark.slow  # starts a real server (python -m cli serve)

READY_DEADLINE_S = 600  # loading and warming up every model on a busy machine


def start_server(port: int, log: Path) -> subprocess.Popen:
    with open(log, "w") as fh:
        return subprocess.Popen([sys.executable, "-m", "cli", "serve", "--llm", "smollm2", "--port", str(port)],
                                cwd=ROOT, env=dict(os.environ), stdout=fh, stderr=subprocess.STDOUT)


def healthz_until_ready(proc: subprocess.Popen, port: int, log: Path) -> list[int]:
    """Poll ``/healthz`` until it answers 200; return every status it gave (503 while warming up)."""
    statuses: list[int] = []
    deadline = time.monotonic() + READY_DEADLINE_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
                statuses.append(r.status)
                return statuses
        except urllib.error.HTTPError as e:
            statuses.append(e.code)  # 503 while warming up
        except OSError:
            pass  # not listening yet: models still loading
        time.sleep(0.05)
    pytest.fail(f"server not ready in {READY_DEADLINE_S} s (statuses {statuses}):\n{log.read_text()[-4000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(1800)
async def test_first_turn_is_as_fast_as_the_later_ones(audio_dir, tmp_path):
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_server(port, log)
    try:
        statuses = await asyncio.to_thread(healthz_until_ready, proc, port, log)
        assert statuses[-1] == 200 and set(statuses) <= {200, 503}, statuses
        # ready came after the warm-up ran (the server logs it before it says it is ready)
        text = log.read_text()
        assert "warm-up (ms)" in text and text.index("warm-up (ms)") < text.index("voxpipe ready"), text[-4000:]
        x, sr = read_mono(audio_dir / "en_librispeech_3752-4944-0000.wav")
        data = (np.clip(resample(x, sr, 16000), -1, 1) * 32767).astype("<i2").tobytes()
        timings = []
        async with Client(f"ws://127.0.0.1:{port}/ws") as c:
            await c.start(sample_rate=16000)
            for _ in range(3):
                done = await c.turn(data)
                assert done["type"] == "response.done"
                timings.append(done["timings_ms"])
        # The first turn against the warm ones, relative (never an absolute time): both
        # run on the same machine under the same load. The slowest warm turn is the
        # yardstick, so a busy machine's noise does not count as a cold start; the
        # margin is far below what the lazy initialisation the warm-up exists for costs.
        first, warm = timings[0], timings[1:]
        for key in ("asr", "llm_ttft", "first_phrase_to_audio"):
            assert first[key] <= max(t[key] for t in warm) * 3 + 500, (key, timings)
    finally:
        await asyncio.to_thread(stop_server, proc)
