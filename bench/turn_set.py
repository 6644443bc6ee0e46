"""The scripted set of ``voxpipe bench turns``: what the user says in each case, built from the
repository's real speech at the cuts stored in bench/turn_cuts.tsv (:mod:`bench.turn_cuts`
says how they were found), plus a few synthetic sounds.

Classes:

- ``complete``: a complete sentence (a whole clip, or one sentence of a two-sentence clip).
- ``pause``: a sentence with a thinking pause of :data:`PAUSES_S` inserted at a mid-sentence
  phrase boundary; the clip's own gap there is removed, so the silence heard is the pause.
- ``backchannel``: a complete sentence, then, while its reply plays, "yeah", "I see", "okay"
  or "right" — synthesised with the repository's Piper voice (the test clips hold none),
  resampled to 16 kHz with soxr. Not "mm-hm": Piper spells it out letter by letter (as it
  does "mhm", "mm", "uh-huh"), which Whisper then hears as words ("and then make them", "M.
  H. M.") and a listener would not take for a backchannel either.
- ``interruption``: a complete sentence, then, while its reply plays, real speech (a clip's
  first phrase, e.g. "go forward ten meters").
- ``noise``: a complete sentence, then, while its reply plays, a non-speech burst: seeded
  synthetic cough (band-passed noise), door (a low thump), keyboard (a click train), or a
  0.5 s cut of the music clip.

A burst starts :data:`BURST_DELAY_S` (seeded) after the reply's first audio reaches the
client, so it also falls within the server's 2 s merge window. Audio is float32 mono at
16 kHz; every case starts with :data:`LEAD_S` of silence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.turn_cuts import AUDIO_DIR, RATE, load_clip, read_cuts, speech_frames

CLASSES = ("complete", "pause", "backchannel", "interruption", "noise")
LEAD_S = 0.5
"""Silence before the user speaks (s)."""
EDGE_S = 0.15
"""Audio of the clip kept before a sentence's first and after its last speech frame (s)."""
PAUSES_S = (0.6, 0.8, 1.0, 1.2, 1.5)
"""Thinking pauses inserted mid-sentence (s)."""
BURST_DELAY_S = (0.5, 1.5)
"""A burst starts this long after the reply's first audio (s, uniform, seeded)."""
BACKCHANNELS = ("Yeah.", "I see.", "Okay.", "Right.")
BACKCHANNEL_PACE = (1.0, 1.3)
"""Piper ``length_scale`` values: each word is spoken at both paces, slowed or hurried further
when that puts it outside :data:`BACKCHANNEL_S`."""
BACKCHANNEL_S = (0.3, 0.8)
"""A backchannel's length (s, its speech frames)."""
BURST_PEAK = 0.4
"""A backchannel's peak level (−8 dBFS, about the clips' speech)."""
NOISES = ("cough", "door", "keyboard", "music")
MUSIC_CLIP = "xx_hard_music_brahms_hungarian_dance5_30s.wav"
SPOKEN_TURNS = 5
"""Turns (c)–(e) answer: the first this many ``turn`` rows of the TSV (the short clips)."""


@dataclass(slots=True)
class Case:
    """One scripted case: ``speech`` is streamed from position 0, then silence.

    Times are positions in the stream (s). ``burst`` (classes backchannel, interruption,
    noise) is sent ``burst_delay_s`` after the reply's first audio arrives; ``burst_onset_s``
    is where in it the sound (an interruption's first word) begins."""

    cls: str
    name: str
    speech: np.ndarray  # float32, 16 kHz, shape (n,)
    true_end_s: float  # the user's true end of speech
    last_start_s: float = 0.0  # where the user's last stretch of speech begins (after the pause)
    pause: tuple[float, float] | None = None  # (start, end) of the inserted pause
    burst: np.ndarray | None = None  # float32, 16 kHz
    burst_delay_s: float = 0.0
    burst_onset_s: float = 0.0
    synthetic: bool = False  # the burst is synthesised (Piper, or generated noise)

    @property
    def duration_s(self) -> float:
        return len(self.speech) / RATE


def _sec(x: np.ndarray, a: float, b: float) -> np.ndarray:
    return x[max(int(round(a * RATE)), 0): int(round(b * RATE))]


def _silence(s: float) -> np.ndarray:
    return np.zeros(int(round(s * RATE)), np.float32)


def sentence(row: dict, clips: dict[str, np.ndarray]) -> tuple[np.ndarray, float]:
    """A ``turn`` row's audio with :data:`LEAD_S` of silence before it; (audio, true end in it, s)."""
    x = clips[row["clip"]]
    a = max(row["start_s"] - EDGE_S, 0.0)
    return np.concatenate([_silence(LEAD_S), _sec(x, a, row["end_s"] + EDGE_S)]), LEAD_S + row["end_s"] - a


def paused(turn: dict, cut: dict, pause_s: float, clips: dict[str, np.ndarray]) -> Case:
    """``turn`` with ``pause_s`` of silence in place of the gap of ``cut`` (a ``pause`` row)."""
    x = clips[turn["clip"]]
    a = max(turn["start_s"] - EDGE_S, 0.0)
    head, tail = _sec(x, a, cut["start_s"]), _sec(x, cut["end_s"], turn["end_s"] + EDGE_S)
    p0 = LEAD_S + len(head) / RATE
    audio = np.concatenate([_silence(LEAD_S), head, _silence(pause_s), tail])
    return Case("pause", f"{cut['before']} | {pause_s:.1f} s | {cut['after']}", audio,
                true_end_s=p0 + pause_s + turn["end_s"] - cut["end_s"], last_start_s=p0 + pause_s,
                pause=(round(p0, 3), round(p0 + pause_s, 3)))


def trim(x: np.ndarray) -> np.ndarray:
    """``x`` from its first to its last speech frame (:func:`bench.turn_cuts.speech_frames`)."""
    idx = np.flatnonzero(speech_frames(x))
    hop = RATE // 100
    return x[idx[0] * hop: (idx[-1] + 1) * hop] if len(idx) else x


def backchannels() -> list[tuple[str, np.ndarray]]:
    """Each of :data:`BACKCHANNELS` at each :data:`BACKCHANNEL_PACE`, spoken by the server's Piper
    voice (``joe``; ``noise_w_scale`` 0, so a word's length is the same every run), trimmed to
    its speech, resampled to 16 kHz and scaled to :data:`BURST_PEAK`: [(word, audio)]."""
    from piper import SynthesisConfig

    from audio.pcm import resample
    from pipeline.config import TtsConfig
    from pipeline.tts.loader import load_voice

    voice = load_voice(TtsConfig())

    def say(word: str, pace: float) -> np.ndarray:
        chunks = voice.synthesize(word, syn_config=SynthesisConfig(length_scale=pace, noise_w_scale=0.0))
        audio = np.concatenate([c.audio_float_array for c in chunks]).astype(np.float32)
        return trim(resample(audio, int(voice.config.sample_rate), RATE))

    out = []
    lo, hi = BACKCHANNEL_S
    for pace in BACKCHANNEL_PACE:
        for word in BACKCHANNELS:
            audio = say(word, pace)
            dur = len(audio) / RATE
            if not lo <= dur <= hi:  # length_scale stretches the phonemes about in proportion
                audio = say(word, pace * (lo + 0.06 if dur < lo else hi - 0.06) / dur)
            out.append((word, (BURST_PEAK / (np.abs(audio).max() + 1e-9) * audio).astype(np.float32)))
    return out


def _band(rng: np.random.Generator, n: int, lo: float, hi: float) -> np.ndarray:
    """White noise band-passed to [lo, hi] Hz (FFT mask), unit peak."""
    spec = np.fft.rfft(rng.standard_normal(n))
    f = np.fft.rfftfreq(n, 1 / RATE)
    spec[(f < lo) | (f > hi)] = 0
    y = np.fft.irfft(spec, n)
    return y / (np.abs(y).max() + 1e-9)


def noise(kind: str, rng: np.random.Generator, music: np.ndarray) -> np.ndarray:
    """A non-speech burst, float32 at 16 kHz: ``cough`` (0.25–0.4 s of 300–3000 Hz noise, fast
    attack, decaying; peak −6 dBFS), ``door`` (a 50–90 Hz thump decaying over ~80 ms with a
    low-passed knock, 0.35 s; peak −6 dBFS), ``keyboard`` (6–12 clicks of 4 ms 2–8 kHz noise
    60–150 ms apart; peak −12 dBFS) or ``music`` (0.5 s of the music clip from a seeded offset)."""
    if kind == "music":
        at = rng.uniform(1.0, len(music) / RATE - 1.5)
        return _sec(music, at, at + 0.5).astype(np.float32)
    if kind == "cough":
        n = int(rng.uniform(0.25, 0.4) * RATE)
        t = np.arange(n) / RATE
        env = np.minimum(t / 0.01, 1.0) * np.exp(-t / rng.uniform(0.06, 0.1))
        y = 0.5 * _band(rng, n, 300, 3000) * env
    elif kind == "door":
        n = int(0.35 * RATE)
        t = np.arange(n) / RATE
        y = 0.5 * (0.8 * np.sin(2 * np.pi * rng.uniform(50, 90) * t) + 0.2 * _band(rng, n, 20, 400)) * np.exp(-t / 0.08)
    elif kind == "keyboard":
        gaps = rng.uniform(0.06, 0.15, int(rng.integers(6, 13)))
        y = np.zeros(int((gaps.sum() + 0.05) * RATE))
        click = int(0.004 * RATE)
        for at in np.cumsum(gaps) - gaps[0]:
            i = int(at * RATE)
            y[i: i + click] += 0.25 * _band(rng, click, 2000, 8000) * np.exp(-np.arange(click) / (0.001 * RATE))
    else:
        raise ValueError(f"unknown noise {kind!r}")
    return y.astype(np.float32)


def build_set(per_class: int, seed: int = 0, classes: tuple[str, ...] = CLASSES,
              audio_dir: Path = AUDIO_DIR) -> list[Case]:
    """``per_class`` cases of each of ``classes``, in class order, the same for the same seed.

    Case k of a class takes the k-th item of its list, cycling: sentences; (cut, pause) pairs
    (cut k mod 11, pause k mod 5: 55 distinct pairs); backchannel words × paces; interrupting
    phrases; noise kinds. Bursts follow the spoken turns in turn, each with a seeded delay.

    Raises:
        ValueError: an unknown class.
    """
    unknown = set(classes) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown classes: {', '.join(sorted(unknown))}")
    rows = read_cuts()
    clips = {r["clip"]: load_clip(r["clip"], audio_dir) for r in rows}
    turns = [r for r in rows if r["kind"] == "turn"]
    cuts = [r for r in rows if r["kind"] == "pause"]
    phrases = [r for r in rows if r["kind"] == "interruption"]
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    bcs = backchannels() if "backchannel" in classes else []
    music = load_clip(MUSIC_CLIP, audio_dir) if "noise" in classes else np.zeros(0, np.float32)
    out: list[Case] = []
    for cls in classes:
        for k in range(per_class):
            if cls == "complete":
                t = turns[k % len(turns)]
                audio, end = sentence(t, clips)
                out.append(Case(cls, t["before"], audio, end))
                continue
            if cls == "pause":
                cut = cuts[k % len(cuts)]
                turn = next(t for t in turns if t["clip"] == cut["clip"] and t["start_s"] < cut["start_s"] < t["end_s"])
                out.append(paused(turn, cut, PAUSES_S[k % len(PAUSES_S)], clips))
                continue
            t = turns[k % SPOKEN_TURNS]
            audio, end = sentence(t, clips)
            case = Case(cls, "", audio, end, burst_delay_s=round(rng.uniform(*BURST_DELAY_S), 3))
            if cls == "backchannel":
                word, case.burst = bcs[k % len(bcs)]
                case.name, case.synthetic = f"{t['before']} + {word} (Piper)", True
            elif cls == "interruption":
                p = phrases[k % len(phrases)]
                x = clips[p["clip"]]
                a = max(p["start_s"] - 0.1, 0.0)
                case.burst, case.burst_onset_s = _sec(x, a, p["end_s"] + EDGE_S), p["start_s"] - a
                case.name = f"{t['before']} + {p['before']}"
            else:
                kind = NOISES[k % len(NOISES)]
                case.burst, case.synthetic = noise(kind, nrng, music), kind != "music"
                case.name = f"{t['before']} + {kind}" + (" (synthetic)" if case.synthetic else " (music clip)")
            out.append(case)
    return out
