"""A private PulseAudio daemon: a room where the speaker is heard by the microphone (for
tests/test_mic_loopback.py and ``voxpipe bench echo``).

Topology (``module-null-sink``s, no sound card):

    voxpipe mic ──▶ sink "speaker" ──monitor──▶ module-loopback (unity gain, ~60 ms) ──▶ sink "room"
    test's human (paplay --device=room) ─────────────────────────────────────────────▶ sink "room"
    voxpipe mic's microphone ◀── "room.monitor" (the default source)

so everything the client plays reaches its microphone at ``leak_db`` (0 dB: unity; None:
not at all, as through headphones), mixed with what a test plays as the human. Clients reach
it through ``PULSE_SERVER`` (PortAudio through ALSA's pulse plugin, which Debian's
``pulseaudio`` package makes the ALSA default while a server runs).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

SCRIPT = """load-module module-native-protocol-unix auth-anonymous=1 socket={socket}
load-module module-null-sink sink_name=speaker rate=48000 sink_properties=device.description=speaker
load-module module-null-sink sink_name=room rate=48000 sink_properties=device.description=room
load-module module-loopback source=speaker.monitor sink=room latency_msec=60
set-default-sink speaker
set-default-source room.monitor
"""


@contextmanager
def pulse_room(folder: Path, leak_db: float | None = 0.0) -> Iterator[dict[str, str]]:
    """Run ``pulseaudio`` with :data:`SCRIPT` in ``folder`` until the block ends; yields the
    environment for its clients (``PULSE_SERVER``, ``XDG_RUNTIME_DIR``).

    Args:
        folder: where the daemon's socket, runtime folder and log go.
        leak_db: the speaker's level at the microphone (dB, ≤ 0: the loopback's volume);
            None: the speaker is not heard at all (the loopback is unloaded).

    Raises:
        RuntimeError: ``pulseaudio`` is not installed or did not come up within 30 s.
    """
    if shutil.which("pulseaudio") is None or shutil.which("paplay") is None:
        raise RuntimeError("pulseaudio and pulseaudio-utils are not installed (.ci/setup.sh installs them)")
    runtime = folder / "run"
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    socket = folder / "native"
    script = folder / "room.pa"
    script.write_text(SCRIPT.format(socket=socket))
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime), PULSE_SERVER=f"unix:{socket}", HOME=str(folder))
    log = open(folder / "pulseaudio.log", "w")
    proc = subprocess.Popen(["pulseaudio", "-n", "--daemonize=no", "--exit-idle-time=-1", "--disallow-exit",
                             "--log-target=stderr", "-F", str(script)], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while subprocess.run(["pactl", "info"], env=env, capture_output=True).returncode != 0:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"pulseaudio did not start: {(folder / 'pulseaudio.log').read_text()[-2000:]}")
            time.sleep(0.2)
        _set_leak(env, leak_db)
        yield env
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _set_leak(env: dict[str, str], leak_db: float | None) -> None:
    """Set the loopback's volume to ``leak_db`` (:func:`pulse_volume`), or unload it for None.

    Raises:
        RuntimeError: the loopback's stream did not appear within 10 s.
    """
    if leak_db is None:
        subprocess.run(["pactl", "unload-module", "module-loopback"], env=env, check=True, capture_output=True)
        return
    deadline = time.time() + 10
    while True:
        listing = subprocess.run(["pactl", "list", "short", "sink-inputs"], env=env, capture_output=True, text=True)
        ids = [line.split()[0] for line in listing.stdout.splitlines() if line.strip()]
        if ids:
            break
        if time.time() > deadline:
            raise RuntimeError("the room's loopback stream did not appear")
        time.sleep(0.1)
    for idx in ids:  # the loopback is the only stream before any client plays
        subprocess.run(["pactl", "set-sink-input-volume", idx, str(pulse_volume(leak_db))], env=env, check=True,
                       capture_output=True)


PA_VOLUME_NORM = 0x10000
"""PulseAudio's 100 % volume (pulse/volume.h)."""


def pulse_volume(db: float) -> int:
    """The raw PulseAudio volume for a gain of ``db`` decibels: its software volumes are cubic
    in amplitude (pulse/volume.c ``pa_sw_volume_from_linear``), so the cube root of the
    amplitude times :data:`PA_VOLUME_NORM`. (pactl's own ``-20dB`` is read as an option.)"""
    return round(PA_VOLUME_NORM * (10 ** (db / 20)) ** (1 / 3))


def play_as_human(env: dict[str, str], wav: Path, *, wait: bool = True) -> subprocess.Popen:
    """Play ``wav`` into the room (the microphone hears it as a person speaking)."""
    p = subprocess.Popen(["paplay", "--device=room", str(wav)], env=env)
    if wait:
        p.wait(120)
    return p


def scaled_copy(src: Path, dst: Path, gain_db: float) -> Path:
    """``src`` at ``gain_db`` (clipped to full scale), as a 16-bit WAV at ``dst``."""
    import soundfile as sf

    data, rate = sf.read(str(src), dtype="float32")
    sf.write(str(dst), np.clip(data * 10 ** (gain_db / 20), -1, 1), rate, subtype="PCM_16")
    return dst
