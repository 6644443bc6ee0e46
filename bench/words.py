"""One-word turns against the ASR's final-decode window (``voxpipe bench words``).

Short words ("yeah", "stop", "no", "thanks") spoken by the repository's Piper voice with its
default random noise scales (``--draws`` draws each: different timings and pitch), placed
as a final decode sees a one-word turn (200 ms before, 250 ms after), decoded by Whisper
with the final's encoder window set to each ``--windows`` value: how many come back as the
word, and the median decode time of one request. It chose ``short_final_window_s``
(:mod:`pipeline.asr.decode`). A measurement, not a test: run it on an idle machine (a few
minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from audio.pcm import RATE, resample
from pipeline.config import AsrConfig, TtsConfig

WORDS = ("Yeah.", "Stop.", "No.", "Okay.", "Yes, please.", "Right.", "Thanks.", "Wait.", "Sure.", "Go on.")


@dataclass(slots=True)
class WordsRow:
    """One window: ``heard`` of ``total`` clips decoded as their word; median ms per decode."""

    window_s: float
    heard: int
    total: int
    ms: float


def _key(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum() or ch == " ").strip()


def clips(draws: int) -> list[tuple[str, np.ndarray]]:
    """``draws`` Piper renditions of every word of :data:`WORDS`, padded as a final sees them."""
    from pipeline.tts.loader import load_voice

    voice = load_voice(TtsConfig())
    out = []
    for word in WORDS:
        for _ in range(draws):
            audio = np.concatenate([c.audio_float_array for c in voice.synthesize(word)])
            x = (0.7 * resample(audio, int(voice.config.sample_rate), RATE)).astype(np.float32)
            out.append((word, np.concatenate([np.zeros(RATE // 5, np.float32), x, np.zeros(RATE // 4, np.float32)])))
    return out


def measure(windows: list[float], draws: int, model: str) -> list[WordsRow]:
    """One row per window over the same clips."""
    from pipeline.asr.decode import BatchDecoder
    from pipeline.asr.loader import load_whisper
    from pipeline.asr.types import DecodeRequest

    cfg = AsrConfig(model=model)
    whisper = load_whisper(cfg)
    data = clips(draws)
    rows = []
    for window in windows:
        decoder = BatchDecoder(whisper, dataclasses.replace(cfg, short_final_window_s=window))
        heard, times = 0, []
        for word, x in data:
            t0 = time.perf_counter()
            res = decoder.decode([DecodeRequest(audio=x, language="en", final=True)])[0]
            times.append((time.perf_counter() - t0) * 1000)
            heard += not isinstance(res, BaseException) and _key(res.text) == _key(word)
        rows.append(WordsRow(window, heard, len(data), statistics.median(times)))
    return rows


def format_table(rows: list[WordsRow], model: str) -> str:
    lines = [f"one-word finals, Whisper {model} ({len(WORDS)} words x {rows[0].total // len(WORDS)} Piper draws)",
             f"{'window s':>9} {'heard':>9} {'ms/decode':>10}"]
    lines += [f"{r.window_s:>9.0f} {r.heard:>4}/{r.total:<4} {r.ms:>10.1f}" for r in rows]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``voxpipe bench words``."""
    p.add_argument("--windows", type=float, nargs="+", default=[5, 10, 15, 30], help="final windows to try (s)")
    p.add_argument("--draws", type=int, default=6, help="Piper renditions per word (6)")
    p.add_argument("--asr-model", default=AsrConfig().model, help="Whisper model (tiny.en)")
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    """``voxpipe bench words``: print the table (JSON with ``--json``)."""
    rows = measure(args.windows, args.draws, args.asr_model)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print(format_table(rows, args.asr_model))
    return 0
