"""Microphone capture and speaker playback for the CLI (sounddevice / PortAudio).

Importing this module does not touch audio hardware; :class:`Player` and
:func:`open_microphone` do.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import numpy as np


class DeviceError(RuntimeError):
    """No usable audio device (or PortAudio is not installed)."""


def _sd():
    try:
        import sounddevice
    except OSError as exc:  # libportaudio2 missing
        raise DeviceError(f"PortAudio not available ({exc}); install libportaudio2") from None
    _quiet_alsa()
    return sounddevice


_ALSA_HANDLER: list = []


def _quiet_alsa() -> None:
    """Keep alsa-lib's own messages (``ALSA lib pcm.c: ... underrun occurred``, printed
    straight to stderr) off the user's terminal: PortAudio reports the errors that matter."""
    if _ALSA_HANDLER:
        return
    import ctypes

    try:
        lib = ctypes.CDLL("libasound.so.2")
    except OSError:  # no ALSA: nothing to quiet
        _ALSA_HANDLER.append(None)
        return
    handler = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int,
                               ctypes.c_char_p)(lambda *_: None)
    lib.snd_lib_error_set_handler(handler)
    _ALSA_HANDLER.append(handler)  # kept alive: alsa-lib holds the pointer


class Player:
    """Gap-free playback of PCM16 chunks pushed from any thread.

    Each chunk carries a ``tag`` (the reply's ``response_id``): :meth:`played` says how many
    of a tag's samples have gone to the device so far — the position the mic client shows
    the reply's text at. ``on_output(block)`` is called from the audio thread with every
    block written (int16, shape (frames,), zeros included): the echo canceller's reference.

    Args:
        sample_rate: output rate (Hz).
        device: sounddevice output device (an index or a name), None for the default.
        on_output: called with each block played, from the audio thread (keep it fast).

    Raises:
        DeviceError: no output device (or PortAudio is missing).
    """

    def __init__(self, sample_rate: int, device=None,
                 on_output: Callable[[np.ndarray], None] | None = None) -> None:
        self._buf: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._lock = threading.Lock()
        self._played: dict[int, int] = {}
        self._on_output = on_output
        self.sample_rate = sample_rate
        sd = _sd()
        try:
            self._stream = sd.OutputStream(samplerate=sample_rate, channels=1, dtype="int16",
                                           device=device, callback=self._callback)
        except Exception as exc:  # noqa: BLE001 - PortAudioError and friends
            raise _open_failed("speaker", "output", device, exc) from None

    @property
    def latency_s(self) -> float:
        """The output stream's latency (s), as PortAudio reports it."""
        return float(getattr(self._stream, "latency", 0.0) or 0.0)

    def start(self) -> None:
        """Start the stream.

        Raises:
            DeviceError: PortAudio could not start it.
        """
        try:
            self._stream.start()
        except Exception as exc:  # noqa: BLE001 - PortAudioError and friends
            raise DeviceError(f"cannot start the speaker: {_one_line(exc)}") from None

    def close(self) -> None:
        self._stream.stop()
        self._stream.close()

    def push(self, pcm16: bytes, tag: int = 0) -> None:
        """Queue PCM16 mono bytes for playback, as part of ``tag``."""
        with self._lock:
            self._buf.append((tag, np.frombuffer(pcm16, dtype="<i2")))

    def flush(self) -> None:
        """Drop everything not yet played (barge-in, cancel)."""
        with self._lock:
            self._buf.clear()

    def played(self, tag: int) -> int:
        """Samples of ``tag`` written to the device so far."""
        with self._lock:
            return self._played.get(tag, 0)

    @property
    def pending(self) -> int:
        """Samples queued and not yet played."""
        with self._lock:
            return sum(len(c) for _, c in self._buf)

    def _callback(self, out, frames, _time, _status) -> None:
        filled = 0
        with self._lock:
            while filled < frames and self._buf:
                tag, chunk = self._buf[0]
                n = min(frames - filled, len(chunk))
                out[filled : filled + n, 0] = chunk[:n]
                filled += n
                self._played[tag] = self._played.get(tag, 0) + n
                if n == len(chunk):
                    self._buf.popleft()
                else:
                    self._buf[0] = (tag, chunk[n:])
        out[filled:, 0] = 0
        if self._on_output is not None:
            self._on_output(out[:, 0])


def open_microphone(sample_rate: int, on_pcm16: Callable[[bytes], None], device=None):
    """Start capturing 16-bit mono audio; ``on_pcm16(bytes)`` is called from the audio
    thread every 20 ms. Returns the started ``sounddevice.InputStream``. ``device``: an index
    or a name (see :func:`resolve_device`), None for the default.

    Raises:
        DeviceError: no input device.
    """
    sd = _sd()
    try:
        stream = sd.InputStream(samplerate=sample_rate, channels=1, dtype="int16", device=device,
                                blocksize=sample_rate // 50, callback=lambda d, *_: on_pcm16(bytes(d)))
        stream.start()
    except Exception as exc:  # noqa: BLE001 - PortAudioError and friends
        raise _open_failed("microphone", "input", device, exc) from None
    return stream


NO_DEVICES = "no audio devices (is a sound server such as PulseAudio or PipeWire running?)"
"""What a machine with no sound card and no sound server gets, from ``--list-devices`` too."""


def _open_failed(what: str, kind: str, device, exc: BaseException) -> DeviceError:
    """The error for a ``what`` (speaker, microphone) that would not open: in plain words when
    none was named and the machine has no ``kind`` ("input", "output") device at all (PortAudio
    then says "Error querying device -1"), else PortAudio's words."""
    if device is None:
        key = "max_input_channels" if kind == "input" else "max_output_channels"
        try:
            devices = _devices()
        except DeviceError:
            devices = []
        if not devices:
            return DeviceError(f"cannot open the {what}: {NO_DEVICES}")
        if not any(d.get(key, 0) > 0 for d in devices):
            return DeviceError(f"cannot open the {what}: no audio {kind} device (voxpipe mic --list-devices "
                               "shows the devices)")
    return DeviceError(f"cannot open the {what}: {_one_line(exc)}")


def _one_line(exc: BaseException) -> str:
    """PortAudio's message on one line (it may span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _devices() -> list[dict]:
    sd = _sd()
    try:
        return [dict(d) for d in sd.query_devices()]
    except Exception as exc:  # noqa: BLE001 - PortAudioError
        raise DeviceError(f"cannot list audio devices: {_one_line(exc)}") from None


def resolve_device(spec: str | int | None, kind: str) -> int | None:
    """The device index for ``--input-device``/``--output-device`` (``kind`` "input" or
    "output"): None stays None (the system default); an all-digit value is an index; any other
    value is a name: an exact name (case-insensitive) wins, else the one device whose name
    contains it.

    Raises:
        DeviceError: no such index, no device of that kind by that name, several match, or
            PortAudio is missing.
    """
    if spec is None:
        return None
    devices = _devices()
    key = "max_input_channels" if kind == "input" else "max_output_channels"
    text = str(spec).strip()
    if text.isdigit():
        i = int(text)
        if i >= len(devices) or devices[i].get(key, 0) < 1:
            raise DeviceError(f"no {kind} device with index {i} (voxpipe mic --list-devices shows them)")
        return i
    able = [(i, d["name"]) for i, d in enumerate(devices) if d.get(key, 0) > 0]
    exact = [i for i, name in able if name.lower() == text.lower()]
    found = exact or [i for i, name in able if text.lower() in name.lower()]
    if len(found) == 1:
        return found[0]
    if not found:
        raise DeviceError(f"no {kind} device matches {text!r} (voxpipe mic --list-devices shows them)")
    names = ", ".join(f"{i}: {devices[i]['name']}" for i in found)
    raise DeviceError(f"{text!r} matches several {kind} devices ({names}); give an index")


def list_devices() -> str:
    """The audio devices, one a line: index, name, input/output channels, host API, and
    ``<`` / ``>`` for the default input / output.

    Raises:
        DeviceError: PortAudio is missing, cannot list devices, or finds none.
    """
    devices = _devices()
    sd = _sd()
    try:
        apis = [a["name"] for a in sd.query_hostapis()]
        default_in, default_out = sd.default.device
    except Exception:  # noqa: BLE001 - no default device: none marked
        apis, default_in, default_out = [], -1, -1
    if not devices:
        raise DeviceError(NO_DEVICES)
    lines = []
    for i, d in enumerate(devices):
        mark = ("<" if i == default_in else " ") + (">" if i == default_out else " ")
        api = apis[d["hostapi"]] if 0 <= d.get("hostapi", -1) < len(apis) else "?"
        ins, outs = d["max_input_channels"], d["max_output_channels"]
        lines.append(f"{mark} {i:>3}  {d['name']}  ({ins} in, {outs} out, {api})")
    return "\n".join(lines + ["(< default input, > default output)"])
