"""The synthesizers behind one TTS stage, one per loaded voice: :class:`PiperSynth` (a Piper
onnxruntime voice) and :class:`EspeakSynth` (the ``espeak-ng`` program). Each turns clean
phrase text into float32 audio; they run in the TTS stage's worker threads, never on the
event loop (:class:`pipeline.tts.engine.TtsEngine`)."""

from __future__ import annotations

import io
import shutil
import subprocess
from typing import Any, Protocol

import numpy as np

from pipeline.tts.types import VoiceInfo

SHRINK_TEXT = "Okay."
"""The one-word run whose end shrinks a Piper voice's arena."""
ESPEAK = "espeak-ng"
"""The espeak-ng program (Debian package ``espeak-ng``)."""
ESPEAK_TIMEOUT_S = 30.0
"""Longest one espeak-ng call may take (s) before it counts as failed."""


class Synth(Protocol):
    """One loaded voice."""

    info: VoiceInfo

    def speak(self, text: str) -> np.ndarray:
        """Speak clean ``text``: float32 in [-1, 1], shape (n,), at ``info.sample_rate`` Hz."""
        ...

    def on_idle(self) -> None:
        """The stage went idle: give back what can be given (a no-op where nothing can)."""
        ...


class PiperSynth:
    """A Piper voice (``piper.PiperVoice``; onnxruntime sessions are safe to run from several
    threads).

    Args:
        voice: the loaded ``PiperVoice`` (:func:`pipeline.tts.loader.load_voice`).
        name: the voice's name. language: its ISO 639-1 code.
    """

    def __init__(self, voice: Any, *, name: str, language: str) -> None:
        self.voice = voice
        self.info = VoiceInfo(name=name, language=language, backend="piper",
                              sample_rate=int(voice.config.sample_rate))

    @property
    def shrinks(self) -> bool:
        """Whether it runs in a bounded arena (:mod:`pipeline.tts.arena`)."""
        return hasattr(self.voice.session, "shrink_next")

    def speak(self, text: str) -> np.ndarray:
        parts = [chunk.audio_float_array for chunk in self.voice.synthesize(text)]
        return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)

    def on_idle(self) -> None:
        """Shrink onnxruntime's arena with a one-word run (a few ms); a no-op without the
        bounded arena."""
        if not self.shrinks:
            return
        self.voice.session.shrink_next()
        for _ in self.voice.synthesize(SHRINK_TEXT):
            pass


class EspeakSynth:
    """The ``espeak-ng`` program with one of its voices: each phrase is one ``espeak-ng -v
    CODE --stdout`` run (text on stdin, a 16-bit WAV back, 22050 Hz). Formant synthesis:
    robotic, but every language espeak-ng knows, with no model file and a few MB of memory.

    Args:
        code: the espeak-ng voice code (``de``, ``fr``, ``en-us``; ``espeak-ng --voices``).
        name: the voice's name. language: its ISO 639-1 code.

    Raises:
        FileNotFoundError: espeak-ng is not installed.
        ValueError: espeak-ng does not know ``code``.
    """

    def __init__(self, code: str, *, name: str, language: str) -> None:
        if shutil.which(ESPEAK) is None:
            raise FileNotFoundError(f"--voice espeak:{code} needs the espeak-ng program: apt-get install espeak-ng")
        self.code = code
        _, rate = self._run("a")  # checks the voice exists; gives the rate
        self.info = VoiceInfo(name=name, language=language, backend="espeak", sample_rate=rate)

    def _run(self, text: str) -> tuple[np.ndarray, int]:
        import soundfile

        done = subprocess.run([ESPEAK, "-v", self.code, "--stdout"], input=text.encode("utf-8"),
                              capture_output=True, timeout=ESPEAK_TIMEOUT_S, check=False)
        if done.returncode != 0 or not done.stdout:
            message = done.stderr.decode("utf-8", "replace").strip() or f"exit status {done.returncode}"
            raise ValueError(f"espeak-ng voice {self.code!r}: {message}")
        audio, rate = soundfile.read(io.BytesIO(done.stdout), dtype="float32", always_2d=True)
        return np.ascontiguousarray(audio[:, 0]), int(rate)

    def speak(self, text: str) -> np.ndarray:
        return self._run(text)[0]

    def on_idle(self) -> None:
        """Nothing to give back: each phrase is its own process."""
