"""Whether this CPU runs voxpipe's kernels: the instruction sets they are compiled for."""

from __future__ import annotations

from pathlib import Path

CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
"""``/proc/cpuinfo`` flags the kernels need (the instruction sets
:data:`~pipeline.llm.runner.native.build.CFLAGS` compiles for)."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The first CPU's flags in ``/proc/cpuinfo`` (or in ``cpuinfo`` when given); empty where
    it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                           if line.startswith("flags")), []))


def missing_flags(cpuinfo: str | None = None) -> list[str]:
    """The flags of :data:`CPU_FLAGS` this CPU lacks (in that order; all of them where
    ``/proc/cpuinfo`` cannot be read)."""
    have = cpu_flags(cpuinfo)
    return [f for f in CPU_FLAGS if f not in have]


def cpu_supported(cpuinfo: str | None = None) -> bool:
    """True when the CPU has every flag in :data:`CPU_FLAGS` (read from ``/proc/cpuinfo``
    unless ``cpuinfo`` is given; False where it cannot be read)."""
    return not missing_flags(cpuinfo)
