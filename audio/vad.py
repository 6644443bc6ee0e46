"""Streaming Silero VAD (v6 ONNX, shipped in the faster-whisper wheel).

The model takes 512-sample windows at 16 kHz (32 ms) prefixed with the last 64 samples
of the previous window, and carries an LSTM state (h, c) of shape (1, 1, 128) between
windows — the same framing as ``faster_whisper.vad.SileroVADModel`` (adapted from
https://github.com/snakers4/silero-vad). One ONNX session is shared by every stream;
each :class:`VadStream` keeps its own state, so sessions never disturb each other.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

WINDOW = 512
"""Samples per VAD window at 16 kHz (32 ms)."""
CONTEXT = 64
"""Samples of the previous window prefixed to each window (Silero v5/v6 framing)."""


class SileroVad:
    """The shared Silero VAD ONNX model.

    Args:
        path: the ``.onnx`` file (see ``pipeline.model_files.silero_vad_path``).
        threads: onnxruntime intra-op threads (default 1).
    """

    def __init__(self, path: str | Path, *, threads: int = 1) -> None:
        import onnxruntime

        opts = onnxruntime.SessionOptions()
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 4
        self._session = onnxruntime.InferenceSession(
            str(path), providers=["CPUExecutionProvider"], sess_options=opts
        )
        self._lock = threading.Lock()

    def step(self, windows: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Run consecutive windows of one stream.

        Args:
            windows: float32, shape (n, 576): 64 context samples + 512 new samples each.
            h, c: float32 LSTM state, shape (1, 1, 128).
        Returns:
            (speech probabilities shape (n,), new h, new c).
        """
        probs = np.empty(len(windows), dtype=np.float32)
        with self._lock:
            for i, win in enumerate(windows):
                out, h, c = self._session.run(None, {"input": win[None, :], "h": h, "c": c})
                probs[i] = float(np.asarray(out).reshape(-1)[0])
        return probs, h, c

    def stream(self) -> VadStream:
        """A new per-session stream with fresh state."""
        return VadStream(self)


class VadStream:
    """Per-session VAD state: feed 16 kHz float32 samples, get one probability per 32 ms."""

    def __init__(self, model: SileroVad) -> None:
        self._model = model
        self._pending = np.zeros(0, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Consume samples (float32, shape (n,), 16 kHz); return probabilities of the
        windows completed by them (float32, shape (k,)), in order."""
        buf = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        k = len(buf) // WINDOW
        self._pending = buf[k * WINDOW :]
        if k == 0:
            return np.zeros(0, dtype=np.float32)
        wins = buf[: k * WINDOW].reshape(k, WINDOW)
        ctx = np.concatenate([self._context[None, :], wins[:-1, -CONTEXT:]], axis=0)
        self._context = wins[-1, -CONTEXT:].copy()
        probs, self._h, self._c = self._model.step(np.concatenate([ctx, wins], axis=1), self._h, self._c)
        return probs
