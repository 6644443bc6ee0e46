"""The end-of-turn stage (:mod:`pipeline.eot`) with the real Smart Turn v3.2 model and real
clips: its verdicts on complete and cut turns, batching across requests, the bounded queue,
the loader's errors, the feature recipe against transformers, and its place in the engines."""

from __future__ import annotations

import asyncio
import importlib.util
import json

import numpy as np
import pytest

from audio.wav import read_mono
from bench.eot import main as bench_eot
from pipeline import metrics
from pipeline.config import VoxpipeConfig
from pipeline.engines import load_eot
from pipeline.eot.features import WINDOW, features, turn_window
from pipeline.eot.loader import load_eot_model
from pipeline.eot.stage import EotEngine
from pipeline.errors import Busy
from pipeline.model_files import ModelNotInstalled, silero_vad_path
from tests.fakes import fake_engines

CLIPS = ("en_librispeech_3752-4944-0000.wav", "en_librispeech_1988-24833-0003.wav", "en_jfk_inaugural_1961.wav")
"""Whole sentences: each ends a turn; cut in half, none does."""


def sample(name: str) -> float:
    """A metric's value now (0 before it has one)."""
    return metrics.REGISTRY.get_sample_value(name) or 0.0


@pytest.fixture(scope="module")
def model():
    return load_eot_model("auto", threads=1)


@pytest.fixture(scope="module")
def turns(audio_dir) -> dict[str, np.ndarray]:
    """Each clip whole (``name``) and its first half (``name/2``), 16 kHz float32."""
    out = {}
    for name in CLIPS:
        audio, rate = read_mono(audio_dir / name)
        assert rate == 16_000
        out[name], out[name + "/2"] = audio, audio[: len(audio) // 2]
    return out


def test_turn_window_keeps_the_end_and_pads_the_front():
    short = np.arange(1, 11, dtype=np.float32)
    w = turn_window(short)
    assert w.shape == (WINDOW,) and w.dtype == np.float32
    assert not w[:-10].any() and np.array_equal(w[-10:], short)
    long = np.arange(WINDOW + 5, dtype=np.float32)
    assert np.array_equal(turn_window(long), long[5:])
    with pytest.raises(ValueError):
        turn_window(np.zeros((2, 10), np.float32))


def test_features_match_transformers_whisper_extractor(turns):
    """The recipe equals transformers' WhisperFeatureExtractor(feature_size=80, chunk_length=8)
    with do_normalize=True on the 8 s window (what pipecat's Smart Turn v3 feeds the model)."""
    from transformers import WhisperFeatureExtractor

    ref = WhisperFeatureExtractor(feature_size=80, chunk_length=8)
    for audio in (turns[CLIPS[0]], turns[CLIPS[2]], turns[CLIPS[1] + "/2"], np.zeros(0, np.float32)):
        want = ref(turn_window(audio), sampling_rate=16_000, do_normalize=True, return_tensors="np",
                   padding="max_length", max_length=WINDOW, truncation=True).input_features[0]
        got = features(audio)
        assert got.shape == want.shape == (80, 800) and got.dtype == np.float32
        assert np.abs(got - want).max() < 1e-4


async def test_whole_sentences_complete_halves_not(model, turns):
    engine = EotEngine(model, batch_size=1)
    engine.start()
    try:
        for name in CLIPS:
            whole, half = await engine.run(turns[name]), await engine.run(turns[name + "/2"])
            assert whole > 0.5, (name, whole)
            assert half < 0.5, (name, half)
    finally:
        engine.stop()


async def test_concurrent_requests_run_as_one_batch_with_the_same_answers(model, turns):
    names = list(turns)
    engine = EotEngine(model, batch_size=8)
    batches_before = sample("voxpipe_eot_batch_size_sum")
    # queued before the worker starts: it takes them all in its first batch
    tasks = [asyncio.create_task(engine.run(turns[n])) for n in names]
    await asyncio.sleep(0)
    assert engine.load().depth == len(names)
    engine.start()
    try:
        together = await asyncio.gather(*tasks)
        assert engine.stats.max_batch == len(names) and engine.stats.batches == 1
        assert sample("voxpipe_eot_batch_size_sum") - batches_before == len(names)
        alone = [await engine.run(turns[n]) for n in names]
    finally:
        engine.stop()
    assert engine.stats.last_batch == 1 and engine.stats.requests == 2 * len(names)
    assert np.allclose(together, alone, atol=1e-4), (together, alone)


async def test_a_full_queue_refuses_with_busy(model, turns):
    engine = EotEngine(model, batch_size=2, queue_size=2)
    refused_before = sample("voxpipe_eot_refused_total")
    tasks = [asyncio.create_task(engine.run(turns[CLIPS[0]])) for _ in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(Busy) as err:
        await engine.run(turns[CLIPS[0]])
    assert err.value.reason == "stage"
    assert engine.stats.refused == 1 and sample("voxpipe_eot_refused_total") - refused_before == 1
    engine.start()
    try:
        assert all(p > 0.5 for p in await asyncio.gather(*tasks))
    finally:
        engine.stop()


async def test_bad_audio_is_refused_before_the_queue(model):
    engine = EotEngine(model)
    with pytest.raises(ValueError, match="one-dimensional"):
        await engine.run(np.zeros((2, 100), np.float32))
    assert engine.load().depth == 0


def test_missing_package_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pipecat" else real(name, *a))
    with pytest.raises(ModelNotInstalled, match=r"pip install --no-deps pipecat-ai==1\.14\.0"):
        load_eot_model("auto")


def test_the_default_model_missing_falls_back_to_silence(monkeypatch, caplog):
    """The default (``auto``) not installed: a warning, no stage, turns end on silence."""
    from pipeline.engines import load_eot

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pipecat" else real(name, *a))
    cfg = VoxpipeConfig()
    cfg.turn.end_of_turn = "smart-turn"
    with caplog.at_level("WARNING"):
        assert load_eot(cfg) is None
    assert "pipecat-ai" in caplog.text and "silence" in caplog.text


def test_missing_or_invalid_model_files_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_eot_model(str(tmp_path / "nope.onnx"))
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not an onnx model")
    with pytest.raises(ValueError, match="not an ONNX model"):
        load_eot_model(str(junk))
    with pytest.raises(ValueError, match="input_features"):  # a real ONNX model, the wrong one (Silero VAD)
        load_eot_model(str(silero_vad_path()))


async def test_engines_load_start_and_report_the_stage():
    cfg = VoxpipeConfig()
    assert load_eot(cfg) is None  # the silence rule: no model
    cfg.turn.end_of_turn = "smart-turn"
    cfg.turn.eot_batch_size = 4
    eot = load_eot(cfg)
    assert isinstance(eot, EotEngine) and eot.max_batch_size == 4 and eot.queue_size == 16
    engines = fake_engines()
    engines.eot = eot
    engines.start()
    try:
        assert 0.0 <= await eot.run(np.zeros(16_000, np.float32)) <= 1.0
        assert set(engines.loads()) == {"asr", "llm", "tts", "eot"}
        text = metrics.render(engines).decode()
        assert 'voxpipe_queue_depth{stage="eot"} 0.0' in text
        assert "voxpipe_eot_batch_seconds_count" in text and "voxpipe_eot_refused_total" in text
    finally:
        engines.stop()
    assert eot._threads == []


def test_bench_eot_prints_every_row(audio_dir, capsys):
    """``voxpipe bench eot`` (one timed run per row): the model rows, the features and the stage."""
    from cli.main import build_parser

    args = build_parser().parse_args(["bench", "eot", "--batches", "1", "2", "--runs", "1", "--json",
                                      "--audio-dir", str(audio_dir)])
    assert bench_eot(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["what"], r["batch"]) for r in out["rows"]] == [("model", 1), ("model", 2), ("features", 1)]
    assert [(r["batch_size"], r["requests"]) for r in out["stage"]] == [(1, 2), (2, 2)]
    assert all(r["ms"] > 0 for r in out["rows"]) and all(0 < r["mean_ms"] <= r["last_ms"] for r in out["stage"])
