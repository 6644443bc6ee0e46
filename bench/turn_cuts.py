"""Where ``voxpipe bench turns`` cuts the repository's speech (tests/data/audio): found once by
``python -m bench.turn_cuts > bench/turn_cuts.tsv`` and stored, so the set is fixed and
reviewable.

How a time is found: faster-whisper (the installed ``tiny.en``, ``word_timestamps=True``)
gives each clip's words; the lists below name, by word index, the complete sentences, the
phrase boundaries inside them and the interrupting phrases. Whisper's word times are only
rough (it often starts the first word at 0.00 s), so every edge is then put on the audio's
own energy: 10 ms frames whose RMS is over ``max(peak − 35 dB, 10th percentile + 15 dB)``
are speech. A sentence or phrase runs from the first to the last speech frame among its
words; a boundary's gap runs from the last speech frame before the boundary to the first
after it (searched within :data:`SEARCH_S` of whisper's time); when the words run on
without a quiet frame, the gap is the quietest frame there (start = end).

TSV columns: ``kind`` (``turn``: a complete sentence; ``pause``: a phrase boundary inside a
``turn`` of the same clip, where the bench inserts a thinking pause; ``interruption``: a short
real phrase spoken over a reply), ``clip``, ``start_s``, ``end_s`` (a turn or phrase: its
speech; a pause: the gap, speech before it ends at ``start_s``, resumes at ``end_s``),
``before`` (the words; a pause: the words before the boundary) and ``after`` (a pause: the
words after it).
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AUDIO_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"
TSV = Path(__file__).resolve().parent / "turn_cuts.tsv"
RATE = 16000
FRAME_S = 0.01
SEARCH_S = 0.3
"""How far from whisper's boundary time the energy gap is searched (s)."""

TURNS = [("en_librispeech_3752-4944-0000.wav", 0, 8), ("en_librispeech_3752-4944-0002.wav", 0, 12),
         ("en_librispeech_1988-24833-0003.wav", 0, 19), ("en_librivox_sense_and_sensibility_01_0880.wav", 0, 8),
         ("en_cmu_goforward.wav", 0, 4), ("en_ljspeech_LJ001-0007.wav", 0, 16),
         ("en_librispeech_1995-1837-0001.wav", 0, 9), ("en_librispeech_1995-1837-0001.wav", 9, 30)]
"""Complete sentences: (clip, first word, end word) as indices into whisper's words."""
PAUSES = [("en_librispeech_3752-4944-0000.wav", 4), ("en_librispeech_1988-24833-0003.wav", 3),
          ("en_librispeech_3752-4944-0002.wav", 8), ("en_librispeech_1988-24833-0003.wav", 6),
          ("en_librispeech_1988-24833-0003.wav", 12), ("en_librivox_sense_and_sensibility_01_0880.wav", 3),
          ("en_ljspeech_LJ001-0007.wav", 3), ("en_ljspeech_LJ001-0007.wav", 5),
          ("en_librispeech_1995-1837-0001.wav", 5), ("en_librispeech_1995-1837-0001.wav", 17),
          ("en_librispeech_1995-1837-0001.wav", 20)]
"""Phrase boundaries mid-sentence: (clip, words before the boundary). Each is a point where the
sentence cannot end yet (a verb still without its object, a preposition, an article, a
subordinate clause before its main one): "Go forward | ten meters" is left out, as "Go
forward" is a complete command that any listener may answer."""
INTERRUPTIONS = [("en_cmu_goforward.wav", 0, 4), ("en_librispeech_1988-24833-0003.wav", 0, 8),
                 ("en_librispeech_1995-1837-0001.wav", 0, 9), ("en_jfk_inaugural_1961.wav", 0, 5),
                 ("en_librispeech_3752-4944-0002.wav", 0, 8)]
"""Interrupting phrases, a clip's first words: (clip, first word, end word)."""


@dataclass(slots=True)
class Word:
    text: str
    start: float
    end: float


def load_clip(name: str, audio_dir: Path = AUDIO_DIR) -> np.ndarray:
    """A clip as float32 mono at 16 kHz, shape (n,) (resampled with soxr, :func:`audio.pcm.resample`)."""
    from audio.pcm import resample
    from audio.wav import read_audio

    data, rate = read_audio(str(audio_dir / name))
    if data.ndim > 1:
        data = data.mean(axis=1)
    return resample(data, rate, RATE)


def speech_frames(x: np.ndarray) -> np.ndarray:
    """Per 10 ms frame: is it speech by the energy rule of the module docstring? bool, shape (frames,)."""
    hop = int(RATE * FRAME_S)
    frames = x[: len(x) // hop * hop].reshape(-1, hop)
    db = 20 * np.log10(np.sqrt(np.mean(frames**2, axis=1)) + 1e-9)
    return db > max(db.max() - 35.0, np.percentile(db, 10) + 15.0)


def _span(on: np.ndarray, t0: float, t1: float) -> tuple[float, float]:
    """First and last speech frame's edges (s) within [t0, t1]."""
    idx = np.flatnonzero(on[int(t0 / FRAME_S): int(np.ceil(t1 / FRAME_S))]) + int(t0 / FRAME_S)
    return round(idx[0] * FRAME_S, 2), round((idx[-1] + 1) * FRAME_S, 2)


def _gap(on: np.ndarray, x: np.ndarray, t: float) -> tuple[float, float]:
    """The boundary's gap near whisper's time ``t`` (s): the longest run of quiet frames
    within :data:`SEARCH_S` of ``t`` (the nearest of equal runs), grown to its full length;
    (speech ends, speech resumes) in s."""
    lo, hi = max(int((t - SEARCH_S) / FRAME_S), 0), min(int((t + SEARCH_S) / FRAME_S), len(on))
    runs: list[tuple[int, int]] = []
    for i in range(lo, hi):
        if not on[i]:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
    if not runs:
        hop = int(RATE * FRAME_S)
        i = min(range(lo, hi), key=lambda k: float(np.sum(x[k * hop:(k + 1) * hop] ** 2)))
        return round(i * FRAME_S, 2), round(i * FRAME_S, 2)
    a, b = max(runs, key=lambda r: (r[1] - r[0], -abs((r[0] + r[1]) / 2 * FRAME_S - t)))
    while a > 0 and not on[a - 1]:
        a -= 1
    while b < len(on) and not on[b]:
        b += 1
    return round(a * FRAME_S, 2), round(b * FRAME_S, 2)


def whisper_words(names: list[str]) -> dict[str, list[Word]]:
    """Each clip's words with whisper's times (s): the installed ``tiny.en``, beam 5."""
    from faster_whisper import WhisperModel

    from pipeline import model_files

    model = WhisperModel(str(model_files.whisper_tiny_en_dir()), device="cpu", compute_type="int8", cpu_threads=1)
    out = {}
    for name in names:
        segs, _ = model.transcribe(str(AUDIO_DIR / name), language="en", word_timestamps=True, beam_size=5,
                                   condition_on_previous_text=False)
        out[name] = [Word(w.word.strip(), w.start, w.end) for s in segs for w in (s.words or [])]
    return out


def find_cuts() -> list[dict[str, str]]:
    """The TSV's rows (module docstring), computed from the clips."""
    names = sorted({c for c, *_ in TURNS + PAUSES + INTERRUPTIONS})
    words = whisper_words(names)
    clips = {n: load_clip(n) for n in names}
    rows = []

    def text(ws: list[Word]) -> str:
        return " ".join(w.text for w in ws)

    for kind, spans in (("turn", TURNS), ("interruption", INTERRUPTIONS)):
        for name, a, b in spans:
            x, ws = clips[name], words[name]
            on = speech_frames(x)
            lo = 0.0 if a == 0 else _gap(on, x, (ws[a - 1].end + ws[a].start) / 2)[1]
            hi = len(x) / RATE if b >= len(ws) else _gap(on, x, (ws[b - 1].end + ws[b].start) / 2)[0]
            s, e = _span(on, lo, hi)
            rows.append({"kind": kind, "clip": name, "start_s": f"{s:.2f}", "end_s": f"{e:.2f}",
                         "before": text(ws[a:b]), "after": ""})
    for name, k in PAUSES:
        ws = words[name]
        turn = next((a, b) for n, a, b in TURNS if n == name and a < k < b)
        s, e = _gap(speech_frames(clips[name]), clips[name], (ws[k - 1].end + ws[k].start) / 2)
        rows.append({"kind": "pause", "clip": name, "start_s": f"{s:.2f}", "end_s": f"{e:.2f}",
                     "before": text(ws[turn[0]:k]), "after": text(ws[k:turn[1]])})
    return rows


FIELDS = ["kind", "clip", "start_s", "end_s", "before", "after"]


def read_cuts(path: Path = TSV) -> list[dict]:
    """The stored rows, times as floats (s)."""
    with open(path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    return [r | {"start_s": float(r["start_s"]), "end_s": float(r["end_s"])} for r in rows]


if __name__ == "__main__":
    w = csv.DictWriter(sys.stdout, FIELDS, delimiter="\t", lineterminator="\n")
    w.writeheader()
    w.writerows(find_cuts())
