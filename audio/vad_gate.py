"""A level gate in front of Silero VAD: a quiet stream costs no model call.

A connected session that sends silence (a muted or idle microphone) would otherwise run
Silero on every 32 ms window (~31 ONNX calls/s per session). Once a stream has been
non-speech for :data:`IDLE_WINDOWS` windows, a window is skipped (probability 0) when its
level is under :data:`ABS_GATE_DBFS` or within :data:`RISE_DB` of the stream's noise floor;
anything louder goes to Silero as before, and so does every window while speech may be
going on. Speech onsets rise well above the floor they start from (on the shared clips the
quietest speech windows are −61 dBFS over a −65 dBFS floor, and the first windows of a
word are louder), so the gate only skips what Silero would call silence anyway.

The floor follows the level of non-speech windows: quickly down, slowly up (the
asymmetric first-order smoothing of classic minimum-tracking noise estimators, e.g.
R. Martin, "Noise power spectral density estimation based on optimal smoothing and
minimum statistics", IEEE TSAP 2001 — here on the window level alone).
"""

from __future__ import annotations

import numpy as np

ABS_GATE_DBFS = -70.0
"""Windows quieter than this (dBFS, RMS re full scale 1.0) are silence: digital zeros, a
muted microphone. Speech in the shared clips never goes under −61 dBFS."""
RISE_DB = 6.0
"""A window this far above the noise floor (dB) may be speech and goes to Silero."""
IDLE_WINDOWS = 16
"""Consecutive non-speech windows (16 × 32 ms = 0.5 s) before the gate may skip any."""
NON_SPEECH_PROB = 0.2
"""A Silero probability under this counts as non-speech for the gate (below the turn
tracker's ``neg_threshold``, 0.35)."""
FLOOR_DOWN, FLOOR_UP = 0.3, 0.02
"""Smoothing weights of the floor towards a quieter / a louder non-speech window."""
FRESH_AFTER = 64
"""Consecutive skipped windows (2 s) after which the model goes on from the state of silence
(:attr:`LevelGate.fresh`; ``SileroVad.quiet_state``: the state it reaches over 1 s of digital
silence), not from the state it had before them, often the end of the last speech. Under
that stale state the onset of a quieter voice scores far lower: a voice at -38 dBFS through
a client's echo canceller, after 4 s of skipped windows, scored 0.1-0.2 for 2 s and never
became speech; from the state of silence, 0.7-0.9. A zero state is no cure: it scored the
same voice 0.5-0.8 but JFK's "ask not" after his 1.75 s pause 0.1-0.4. Within 2 s (the
session's merge window) the state is kept: the speaker going on after a pause is judged
under the state of their own speech."""


def window_dbfs(windows: np.ndarray) -> np.ndarray:
    """RMS level of each window in dBFS.

    Args:
        windows: float32 samples in [-1, 1], shape (k, n).
    Returns:
        float64, shape (k,); −240 for digital silence.
    """
    x = np.asarray(windows, dtype=np.float64)
    power = np.einsum("ij,ij->i", x, x) / max(1, x.shape[1])  # one pass, no temporaries
    return 10.0 * np.log10(np.maximum(power, 1e-24))


class LevelGate:
    """Per-stream gate state: which windows need Silero.

    Call :meth:`needs_model` for each window's level in order, then :meth:`observe` with
    the probability it got (computed, or 0 when skipped).
    """

    def __init__(self) -> None:
        self.floor_db: float | None = None
        self._quiet = 0  # consecutive non-speech windows
        self.skipped = 0
        """Windows skipped so far (for tests and stats)."""
        self._skipped_run = 0  # consecutive skipped windows

    @property
    def fresh(self) -> bool:
        """The model's next window should go on from the state of silence: the last
        :data:`FRESH_AFTER` windows or more were skipped."""
        return self._skipped_run >= FRESH_AFTER

    def needs_model(self, db: float) -> bool:
        """Whether a window at level ``db`` (dBFS) must go to Silero."""
        if self._quiet < IDLE_WINDOWS:
            return True
        if db < ABS_GATE_DBFS:
            return False
        return self.floor_db is None or db >= self.floor_db + RISE_DB

    def observe(self, db: float, prob: float, *, skipped: bool) -> None:
        """Account a window at level ``db`` with speech probability ``prob``."""
        self._skipped_run = self._skipped_run + 1 if skipped else 0
        if skipped:
            self.skipped += 1
        if prob >= NON_SPEECH_PROB:
            self._quiet = 0
            return
        self._quiet += 1
        if db < ABS_GATE_DBFS:
            return  # digital silence says nothing about the room's noise
        if self.floor_db is None:
            self.floor_db = db
        else:
            w = FLOOR_DOWN if db < self.floor_db else FLOOR_UP
            self.floor_db += w * (db - self.floor_db)
