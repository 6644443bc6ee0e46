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

from audio.vad_gate import LevelGate, window_dbfs

WINDOW = 512
"""Samples per VAD window at 16 kHz (32 ms)."""
CONTEXT = 64
"""Samples of the previous window prefixed to each window (Silero v5/v6 framing)."""
QUIET_STATE_S = 1.0
"""Seconds of digital silence that make :meth:`SileroVad.quiet_state`."""


class SileroVad:
    """The shared Silero VAD ONNX model.

    Args:
        path: the ``.onnx`` file (see ``pipeline.model_files.silero_vad_path``).
        threads: onnxruntime intra-op threads (default 1).
        gate: skip quiet windows after non-speech (:mod:`audio.vad_gate`; default True).
    """

    def __init__(self, path: str | Path, *, threads: int = 1, gate: bool = True) -> None:
        self.gate = gate
        import onnxruntime

        opts = onnxruntime.SessionOptions()
        opts.inter_op_num_threads = 1
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 4
        self._session = onnxruntime.InferenceSession(
            str(path), providers=["CPUExecutionProvider"], sess_options=opts
        )
        self._lock = threading.Lock()
        zeros = np.zeros((round(QUIET_STATE_S * 16000) // WINDOW, CONTEXT + WINDOW), dtype=np.float32)
        state = np.zeros((1, 1, 128), dtype=np.float32)
        _, h, c = self.step(zeros, state, state.copy())  # here, where the model loads: not on a stream's thread
        self._quiet_state = (np.asarray(h, dtype=np.float32), np.asarray(c, dtype=np.float32))

    def quiet_state(self) -> tuple[np.ndarray, np.ndarray]:
        """The LSTM state (h, c; float32, shape (1, 1, 128) each) the model reaches from a
        zero state over :data:`QUIET_STATE_S` of digital silence: where a stream whose quiet
        windows the gate skipped would be had the model seen them (copies; computed when the
        model loads)."""
        return self._quiet_state[0].copy(), self._quiet_state[1].copy()

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
    """Per-session VAD state: feed 16 kHz float32 samples, get one probability per 32 ms.

    Quiet windows after half a second of non-speech skip the model (probability 0; see
    :mod:`audio.vad_gate`): a silent session costs almost nothing. After 2 s or more of
    skipped windows the model goes on from the state of silence
    (:data:`~audio.vad_gate.FRESH_AFTER`, :meth:`SileroVad.quiet_state`)."""

    def __init__(self, model: SileroVad) -> None:
        self._model = model
        self._pending = np.zeros(0, dtype=np.float32)
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._h = np.zeros((1, 1, 128), dtype=np.float32)
        self._c = np.zeros((1, 1, 128), dtype=np.float32)
        self._gate = LevelGate() if model.gate else _NoGate()

    @property
    def skipped(self) -> int:
        """Windows not sent to the model because they were quiet (:mod:`audio.vad_gate`)."""
        return self._gate.skipped

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Consume samples (float32, shape (n,), 16 kHz); return probabilities of the
        windows completed by them (float32, shape (k,)), in order."""
        buf = np.concatenate([self._pending, samples.astype(np.float32, copy=False)])
        k = len(buf) // WINDOW
        self._pending = buf[k * WINDOW :]
        if k == 0:
            return np.zeros(0, dtype=np.float32)
        wins = buf[: k * WINDOW].reshape(k, WINDOW)
        context = self._context
        self._context = wins[-1, -CONTEXT:].copy()
        framed: np.ndarray | None = None  # each window with its context: built only if the model runs
        probs = np.zeros(k, dtype=np.float32)
        levels = window_dbfs(wins).tolist()
        i = 0
        while i < k:  # runs of windows that need the model go to it together, in order
            j = i
            while j < k and self._gate.needs_model(levels[j]):
                j += 1
            if j > i:
                if self._gate.fresh:  # after a long skipped run: the state of silence (vad_gate.FRESH_AFTER)
                    self._h, self._c = self._model.quiet_state()
                if framed is None:
                    ctx = np.concatenate([context[None, :], wins[:-1, -CONTEXT:]], axis=0)
                    framed = np.concatenate([ctx, wins], axis=1)
                probs[i:j], self._h, self._c = self._model.step(framed[i:j], self._h, self._c)
                for n in range(i, j):
                    self._gate.observe(levels[n], float(probs[n]), skipped=False)
            else:  # a quiet window: probability 0, the LSTM state untouched (until FRESH_AFTER of them)
                self._gate.observe(levels[i], 0.0, skipped=True)
                j = i + 1
            i = j
        return probs


class _NoGate(LevelGate):
    """Every window goes to the model (``--no-vad-gate``)."""

    def needs_model(self, db: float) -> bool:
        return True
