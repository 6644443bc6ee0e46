"""A stand-in for the ``sounddevice`` module (the PortAudio boundary) for mic client tests:
devices to list, and streams that run in real time on threads — the speaker "plays" into a
:class:`Room`, the microphone hears the room: the test's human voice, plus (``echo_gain``)
what the speaker played, as a loudspeaker next to the microphone would."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

DEVICES = [
    {"name": "HDMI output", "hostapi": 0, "max_input_channels": 0, "max_output_channels": 2},
    {"name": "USB Mic", "hostapi": 0, "max_input_channels": 1, "max_output_channels": 0},
    {"name": "Built-in Audio", "hostapi": 0, "max_input_channels": 2, "max_output_channels": 2},
    {"name": "Built-in Audio Loopback", "hostapi": 0, "max_input_channels": 2, "max_output_channels": 2},
]
BLOCK_S = 0.02


class PortAudioError(Exception):
    pass


class Room:
    """What the microphone hears. ``say(x)`` queues float32 16 kHz speech; ``echo_gain``
    scales the speaker's output into the microphone (1.0: 0 dB)."""

    def __init__(self, echo_gain: float = 0.0) -> None:
        self.echo_gain = echo_gain
        self._lock = threading.Lock()
        self._human = np.zeros(0, np.float32)
        self._echo: collections.deque[np.ndarray] = collections.deque()
        self.played: list[np.ndarray] = []  # every speaker block (int16)
        self.sent_silence = 0  # microphone blocks that reached the client as all zeros

    def say(self, audio: np.ndarray) -> None:
        with self._lock:
            self._human = np.concatenate([self._human, audio.astype(np.float32)])

    @property
    def human_pending(self) -> int:
        with self._lock:
            return len(self._human)

    def speaker(self, block: np.ndarray, rate: int) -> None:
        self.played.append(block.copy())
        if self.echo_gain:
            n16 = round(len(block) * 16000 / rate)
            x = np.interp(np.linspace(0, len(block) - 1, n16), np.arange(len(block)), block.astype(np.float32))
            with self._lock:
                self._echo.append(x / 32768 * self.echo_gain)

    def microphone(self, n: int) -> np.ndarray:
        with self._lock:
            out = np.zeros(n, np.float32)
            k = min(n, len(self._human))
            out[:k] = self._human[:k]
            self._human = self._human[k:]
            filled = 0
            while filled < n and self._echo:
                e = self._echo[0]
                m = min(n - filled, len(e))
                out[filled : filled + m] += e[:m]
                filled += m
                if m == len(e):
                    self._echo.popleft()
                else:
                    self._echo[0] = e[m:]
        return (np.clip(out, -1, 1) * 32767).astype(np.int16)

    def played_seconds(self, rate: int) -> float:
        """Seconds of non-silent speaker output so far."""
        return sum(len(b) for b in self.played if np.any(b)) / rate


class _Stream:
    latency = 0.02

    def __init__(self, sd: FakeSoundDevice, kind: str, samplerate, channels, dtype, device=None, callback=None,
                 blocksize=None) -> None:
        if sd.fail_open:
            raise PortAudioError(f"Error opening {kind} stream: {sd.fail_open}\n[PaErrorCode -9996]")
        if device is not None and not (isinstance(device, int) and 0 <= device < len(sd.devices)):
            raise PortAudioError(f"No device {device!r}")
        self.sd, self.kind, self.rate, self.device, self.callback = sd, kind, int(samplerate), device, callback
        self.block = blocksize or int(self.rate * BLOCK_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        sd.opened.append(self)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t = time.monotonic()
        while not self._stop.is_set():
            if self.kind == "output":
                out = np.zeros((self.block, 1), np.int16)
                self.callback(out, self.block, None, None)
                self.sd.room.speaker(out[:, 0], self.rate)
            else:
                self.callback(self.sd.room.microphone(self.block)[:, None], self.block, None, None)
            t += self.block / self.rate
            time.sleep(max(0.0, t - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def close(self) -> None:
        self.stop()


class FakeSoundDevice:
    """What ``audio.devices`` uses of ``sounddevice``."""

    PortAudioError = PortAudioError

    def __init__(self, room: Room | None = None, devices: list[dict] | None = None, fail_open: str = "") -> None:
        self.room = room or Room()
        self.devices = DEVICES if devices is None else devices
        self.fail_open = fail_open
        self.opened: list[_Stream] = []
        self.default = type("Default", (), {"device": (2, 2)})()

    def query_devices(self):
        return list(self.devices)

    def query_hostapis(self):
        return [{"name": "ALSA"}]

    def OutputStream(self, **kw) -> _Stream:
        return _Stream(self, "output", **kw)

    def InputStream(self, **kw) -> _Stream:
        return _Stream(self, "input", **kw)
