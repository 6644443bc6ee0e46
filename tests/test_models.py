"""The real small models, stage by stage (no server)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from audio.pcm import resample
from audio.vad import SileroVad
from audio.wav import read_mono
from pipeline import model_files
from pipeline.asr.engine import AsrEngine
from pipeline.asr.guards import cut_repetition
from pipeline.asr.loader import load_whisper
from pipeline.asr.types import AsrRequest
from pipeline.config import AsrConfig, TtsConfig, TurnConfig
from pipeline.llm.detok import IncrementalDetokenizer
from pipeline.session.endpointing import Endpointer, SpeechEnd
from pipeline.tts.engine import TtsEngine
from pipeline.tts.loader import load_voice
from tests.wsclient import wer


@pytest.fixture(scope="module")
def asr():
    cfg = AsrConfig()
    return AsrEngine(load_whisper(cfg), cfg)


@pytest.fixture(scope="module")
def vad():
    return SileroVad(model_files.silero_vad_path())


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pipeline.llm.loader import llm_folder

    return AutoTokenizer.from_pretrained(str(llm_folder("smollm2")))


def clip(audio_dir, name):
    x, sr = read_mono(audio_dir / name)
    return resample(x, sr, 16000)


@pytest.mark.slow
def test_asr_english_clips_within_wer(asr, audio_dir, manifest):
    for name, row in manifest.items():
        if row["language"] != "en" or "hard" in name:
            continue
        text = asr.transcribe(AsrRequest(clip(audio_dir, name))).text
        assert wer(row["reference_transcript"], text) <= 0.25, (name, text)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["zeros", "noise-60dBFS"])
def test_asr_silence_gives_no_words(asr, kind):
    rng = np.random.default_rng(0)
    n = 16000 * 5
    x = np.zeros(n, np.float32) if kind == "zeros" else (rng.standard_normal(n) * 1e-3).astype(np.float32)
    assert asr.transcribe(AsrRequest(x)).text == ""


def turns(vad, x, cfg: TurnConfig | None = None):
    ep, stream = Endpointer(cfg or TurnConfig()), vad.stream()
    out = []
    for i in range(0, len(x), 4096):
        out += [e for e in ep.feed(stream.feed(x[i : i + 4096])) if isinstance(e, SpeechEnd)]
    if (end := ep.finish()) is not None:
        out.append(end)
    return out


@pytest.mark.slow
def test_vad_music_and_silence_have_no_turns(vad, audio_dir):
    assert turns(vad, clip(audio_dir, "xx_hard_music_brahms_hungarian_dance5_30s.wav")) == []
    assert turns(vad, np.zeros(16000 * 20, np.float32)) == []
    noise = (np.random.default_rng(1).standard_normal(16000 * 20) * 1e-3).astype(np.float32)
    assert turns(vad, noise) == []


@pytest.mark.slow
def test_silence_padded_clip_gives_exactly_its_sentence(vad, asr, audio_dir, manifest):
    name = "en_hard_silencepad_librispeech_3752-4944-0000.wav"
    x = clip(audio_dir, name)
    found = turns(vad, x)
    assert len(found) == 1
    seg = x[max(0, found[0].start - 3200) : found[0].end + 3200]
    assert len(seg) < 16000 * 6
    text = asr.transcribe(AsrRequest(seg)).text
    assert wer(manifest[name]["reference_transcript"], text) <= 0.15, text


def test_cut_repetition():
    assert cut_repetition("i think i think i think i think i think so") == "i think i think i think so"
    assert cut_repetition("the the the the the end") == "the the the end"
    assert cut_repetition("ask not what your country can do for you") == "ask not what your country can do for you"


@pytest.mark.slow  # the SmolLM2 tokenizer (converted from the GGUF on first use)
@pytest.mark.parametrize("text", ["Hello 🙂 world! 你好, 世界. Ça va? 🎉🎉", "naïve café — 東京タワー 👍🏽"])
def test_incremental_detok_is_exact(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer)
    deltas = [d.add(i) for i in ids] + [d.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in x for x in deltas)


@pytest.mark.slow
def test_tts_speaks_words_and_skips_empty():
    tts = TtsEngine(load_voice(TtsConfig()), TtsConfig())
    assert len(tts.synthesize("Hello there, how are you?").audio) > tts.sample_rate * 0.5
    for text in ["", " ", ".", "…", "?!", "\n", "🙂", "—"]:
        assert len(tts.synthesize(text).audio) == 0
    for text in ["a", "7", "Okay."]:
        assert len(tts.synthesize(text).audio) > 0


async def test_worker_batches_and_reports_busy():
    from pipeline.errors import Busy
    from pipeline.worker import BatchWorker

    class Echo(BatchWorker[int, int]):
        def __init__(self):
            super().__init__("echo", queue_size=2, max_batch_size=4, max_wait_ms=50)
            self.batches = []

        def process_batch(self, items):
            self.batches.append(list(items))
            return [i * 2 if i >= 0 else ValueError("negative") for i in items]

    w = Echo()
    futs = [w.submit(i) for i in (1, 2)]
    with pytest.raises(Busy):
        w.submit(3)
    w.start()
    assert await asyncio.gather(*futs) == [2, 4]
    assert w.batches == [[1, 2]]
    with pytest.raises(ValueError):
        await w.run(-1)
    assert await w.run(5) == 10
    w.stop()
