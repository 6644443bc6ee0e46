"""A spoken turn refused by admission keeps its words on the real server (issue 37, item 3):
real speech (the JFK clip, 11 s), a ``busy``, then its ``transcript.final`` with the words,
``unanswered``. Admission is made to refuse it with ``--slo-ms 100`` (every prediction misses)
while the server is not idle: the LLM's first step after warm-up sleeps 30 s
(``--fault llm:slow:30000@1x1``), so a typed turn's request waits in its queue."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from audio.pcm import resample
from audio.wav import read_mono
from tests.conftest import running_server
from tests.wsclient import MODEL_DEADLINE_S, Client, wer

pytestmark = pytest.mark.slow  # a real server with the real models

JFK = "en_jfk_inaugural_1961.wav"


def pcm16(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def _queue_a_request(url: str, clients: list[Client]) -> None:
    """Make the LLM's queue non-empty: one typed turn's request stalls the LLM (the slow
    fault's step), a second one's waits behind it (each admitted: the server is idle then)."""
    for text in ("Tell me about the sea.", "Tell me about the sky."):
        c = Client(url)
        await c.__aenter__()
        clients.append(c)
        await c.start(sample_rate=16000, output_sample_rate=8000)
        for _ in range(10):  # the first request may not be in the stalled step yet: then a busy
            n = len(c.conv.events)
            await c.send_json({"type": "text.input", "text": text})
            got = await c.wait_for(lambda e, n=n, c=c: e["type"] in ("response.started", "busy")
                                   and c.conv.events.index(e) >= n, MODEL_DEADLINE_S)
            if got["type"] == "response.started":
                break
            await asyncio.sleep(0.5)
        else:
            pytest.fail(f"a typed turn was never admitted: {c.conv.events}")
        await asyncio.sleep(1.0)  # its request reaches the LLM (the first: into the stalled step)


@pytest.mark.timeout(900)
async def test_a_refused_spoken_turn_still_gets_its_transcript_final(tmp_path, audio_dir, manifest):
    x, sr = read_mono(audio_dir / JFK)
    speech = resample(x, sr, 16000)
    with running_server(tmp_path / "serve.log", "--slo-ms", "100", "--fault", "llm:slow:30000@1x1",
                        lenient=False) as (port, _):
        url = f"ws://127.0.0.1:{port}/ws"
        others: list[Client] = []
        try:
            await _queue_a_request(url, others)
            async with Client(url) as c:
                await c.start(sample_rate=16000, format="pcm16", channels=1, output_sample_rate=8000)
                await c.send_audio(pcm16(speech))
                await c.send_json({"type": "input.end"})
                busy = await c.wait_for("busy", MODEL_DEADLINE_S)
                final = await c.wait_for("transcript.final", MODEL_DEADLINE_S)
                events = [e["type"] for e in c.conv.events]
                assert busy["reason"] == "queue", busy
                assert final["turn_id"] == busy["turn_id"] and final["unanswered"] is True, final
                assert events.index("busy") < events.index("transcript.final")
                # decoded (the ASR stage had nothing else to do): the whole utterance
                assert final["source"] == "asr", final
                assert wer(manifest[JFK]["reference_transcript"], final["text"]) <= 0.2, final["text"]
                assert final["audio_ms"] >= 8000  # the speech (VAD finds it in the 11 s clip)
                assert "response.started" not in events
        finally:
            for o in others:
                await o.__aexit__(None, None, None)
