"""Shared fixtures: a real voxpipe server (SmolLM2 for speed) on loopback, and the clips."""

from __future__ import annotations

import csv
import os
import socket
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AUDIO_DIR = Path(os.environ.get("VOXPIPE_TEST_AUDIO", ROOT / "tests" / "data" / "audio"))


DEFAULT_LLM_FILES = frozenset({"test_bench_quality.py", "test_default_llm.py", "test_parrot.py",
                               "test_reply_language_models.py"})
"""Files that load the default 1.5B LLM in fp32 (about 6 GB each): one worker runs them, one
after another, so two of them never hold that memory at once."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``-n 2 --dist loadgroup``, pyproject's addopts) each test file runs
    whole on one worker — its module fixtures (a server, a Ray instance, a model) are set up
    once — and the files that load the default LLM share one worker (:data:`DEFAULT_LLM_FILES`)."""
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("default-llm" if name in DEFAULT_LLM_FILES else name))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked ``native`` (they run voxpipe's C kernels) skip, with the reason, where the
    kernels are not available: ``VOXPIPE_NATIVE=0`` (CI's PyTorch-only run), the CPU, no compiler."""
    if item.get_closest_marker("native") is not None:
        from pipeline.llm.runner import native

        reason = native.status().reason
        if reason:
            pytest.skip(f"voxpipe's C kernels not available: {reason}")


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


LENIENT = ("--slo-ms", "60000", *(a for s in ("asr", "llm", "tts") for a in ("--breaker-slow-ms", f"{s}=60000")))
"""Flags that keep a test server's admission and slow-call breakers out of the way on a loaded
machine (two test workers on two cores, or a CI box busy with something else): a 60 s latency
SLO and 60 s slow-call thresholds. A test's own flags come after them and win."""


@contextmanager
def running_server(log: Path, *args: str, ready_s: float = 600, port: int | None = None, lenient: bool = True):
    """Run ``voxpipe serve --llm smollm2 ARGS`` on ``port`` (None: a free one) until the
    block ends; yields ``(port, proc)`` once ``/healthz`` answers (the test fails with the
    log's tail if it exits or is not ready within ``ready_s``).

    ``lenient`` puts :data:`LENIENT` before ``ARGS``; tests of admission, breakers or the
    degradation ladder pass ``lenient=False`` to get the server's own defaults."""
    port = port or free_port()
    args = (*LENIENT, *args) if lenient else args
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="10000")
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "serve", "--llm", "smollm2", "--port", str(port), *args],
            cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
        )
        try:
            wait_ready(proc, f"http://127.0.0.1:{port}/healthz", log, ready_s)
            yield port, proc
        finally:
            stop_process(proc)


def wait_ready(proc: subprocess.Popen, url: str, log: Path, ready_s: float, what: str = "server") -> None:
    """Wait until ``url`` answers 200; fail with ``log``'s tail if ``proc`` exits first or
    ``ready_s`` pass."""
    deadline = time.time() + ready_s
    while True:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.time() > deadline:
            pytest.fail(f"{what} not ready in time:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)


def stop_process(proc: subprocess.Popen, wait_s: float = 60) -> None:
    """Terminate ``proc``; kill it if it has not exited within ``wait_s``."""
    from bench.server import stop_server

    stop_server(proc, wait_s)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """``voxpipe serve --llm smollm2`` on a free port: its URLs, process and log.

    Its latency SLO and breakers are lenient (:data:`LENIENT`): these tests check everything
    but admission, on machines that may be loaded; admission on the real server with the
    default SLO is tests/test_admission_server.py's."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    with running_server(log) as (port, proc):
        yield {"url": f"ws://127.0.0.1:{port}/ws", "http": f"http://127.0.0.1:{port}", "proc": proc, "log": log}
