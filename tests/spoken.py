"""Short phrases spoken at test time by the repository's own Piper voice (pipeline/tts):
the shared clips hold no lone words ("yeah", "stop")."""

from __future__ import annotations

import numpy as np

from audio.pcm import RATE, resample


def spoken(text: str, *, gain: float = 0.7) -> np.ndarray:
    """``text`` spoken by Piper's default voice, float32 at 16 kHz, scaled by ``gain``.

    Deterministic: Piper's noise scales are 0 (its defaults draw random noise, and Whisper
    tiny heard some draws of "Yeah." and not others)."""
    from piper import SynthesisConfig

    from pipeline.config import TtsConfig
    from pipeline.tts.loader import load_voice

    voice = load_voice(TtsConfig())
    chunks = voice.synthesize(text, syn_config=SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0))
    audio = np.concatenate([c.audio_float_array for c in chunks])
    return (gain * resample(audio, int(voice.config.sample_rate), RATE)).astype(np.float32)
