"""Shared fixtures: a real voxpipe server (SmolLM2 for speed) on loopback, and the clips."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AUDIO_DIR = Path(os.environ.get("VOXPIPE_TEST_AUDIO", ROOT.parent / "shared" / "audio"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def audio_dir() -> Path:
    if not (AUDIO_DIR / "manifest.tsv").exists():
        pytest.fail(f"test clips not found at {AUDIO_DIR} (set VOXPIPE_TEST_AUDIO)")
    return AUDIO_DIR


@pytest.fixture(scope="session")
def manifest(audio_dir) -> dict[str, dict]:
    with open(audio_dir / "manifest.tsv", newline="", encoding="utf-8") as fh:
        return {row["file"]: row for row in csv.DictReader(fh, delimiter="\t")}


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """Start ``voxpipe serve --llm smollm2`` on a free port; yields its ws:// URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "serve.log"
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    fh = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "server.cli", "serve", "--llm", "smollm2", "--port", str(port)],
        cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
    )
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail(f"server not ready in time:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    yield {"url": f"ws://127.0.0.1:{port}/ws", "http": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    fh.close()
