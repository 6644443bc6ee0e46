"""Cold start (CASES C17): ready only after warm-up; the first turn costs about what the second does."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np

from audio.pcm import resample
from audio.wav import read_mono
from tests.conftest import ROOT, free_port
from tests.wsclient import Client


async def test_first_turn_is_as_fast_as_the_second(audio_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--llm", "smollm2", "--port", str(port)],
                            cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        statuses = []
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    statuses.append(r.status)
                    break
            except urllib.error.HTTPError as e:
                statuses.append(e.code)  # 503 while warming up
            except OSError:
                pass  # not listening yet: models still loading
            time.sleep(0.05)
        assert statuses and statuses[-1] == 200 and set(statuses) <= {200, 503}
        x, sr = read_mono(audio_dir / "en_librispeech_3752-4944-0000.wav")
        data = (np.clip(resample(x, sr, 16000), -1, 1) * 32767).astype("<i2").tobytes()
        timings = []
        async with Client(f"ws://127.0.0.1:{port}/ws") as c:
            await c.start(sample_rate=16000)
            for _ in range(2):
                done = await c.turn(data, timeout=120)
                assert done["type"] == "response.done"
                timings.append(done["timings_ms"])
        first, second = timings
        assert first["asr"] < second["asr"] * 1.3 + 100, timings
        assert first["llm_ttft"] < second["llm_ttft"] * 1.3 + 100, timings
        assert first["first_phrase_to_audio"] < second["first_phrase_to_audio"] * 1.3 + 100, timings
    finally:
        proc.terminate()
        proc.wait(timeout=20)
