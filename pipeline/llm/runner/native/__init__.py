"""voxpipe's C kernels for CPU decode, and the one switch that turns them off.

Three kernels, compiled together into one shared library (:mod:`.build`) and bound through
ctypes (:mod:`.bindings`, checked against the C prototypes in ``kernels.h``):

* ``q4_vnni.c``: int4-weight × int8-activation GEMM on AVX-512 VNNI (:mod:`.q4`), for the
  ``cpu-int4`` linear layers;
* ``decode_attn.c``: attention of one query token per row (:mod:`.attn`), for decode steps
  and prompt chunks;
* ``argmax.c``: greedy decoding's argmax over bf16 logits (:mod:`.argmax`).

``VOXPIPE_NATIVE=0`` in the environment turns all three off: no library is built or loaded,
and the callers run PyTorch's kernels (``_weight_int4pack_mm_for_cpu`` for int4, per-row
PyTorch decode attention, ``torch.argmax``). Where the CPU lacks the instruction sets
(:mod:`.cpu`) the same happens quietly (:func:`status` says why); where no C compiler is
found or the build fails, with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass

from pipeline.llm.runner.native import bindings, build, cpu

logger = logging.getLogger(__name__)

SWITCH = "VOXPIPE_NATIVE"
"""Environment variable: ``0`` turns voxpipe's kernels off (anything else, or unset: on where they run)."""
OLD_SWITCH = "VOXPIPE_NATIVE_INT4"
"""The int4 kernel's former switch, no longer read (a warning says so where it is set)."""


@dataclass(frozen=True)
class Status:
    """The kernels' library, or why there is none.

    Attributes:
        library: the loaded library with every function bound (:mod:`.bindings`), or None.
        reason: why ``library`` is None (empty when it is loaded).
    """

    library: ctypes.CDLL | None
    reason: str = ""


def enabled() -> bool:
    """False when ``VOXPIPE_NATIVE=0`` turns the kernels off."""
    return os.environ.get(SWITCH, "1") != "0"


@functools.cache
def status() -> Status:
    """Build (or take from the cache) and load the library, once per process (:func:`reset`
    forgets it)."""
    if OLD_SWITCH in os.environ:
        logger.warning("%s is no longer read: %s=0 turns voxpipe's C kernels off", OLD_SWITCH, SWITCH)
    if not enabled():
        return Status(None, f"{SWITCH}=0")
    missing = cpu.missing_flags()
    if missing:
        return Status(None, f"the CPU lacks {', '.join(missing)}")
    try:
        path = build.build()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # it passed its checksum but will not load: build it again, once
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(build.build()))
        return Status(bindings.bind(lib))
    except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("voxpipe's C kernels unavailable, using PyTorch's: %s", exc)
        return Status(None, str(exc))


def library() -> ctypes.CDLL | None:
    """The kernels' library, every function bound; None where it is off or cannot run here."""
    return status().library


def available() -> bool:
    """True when the kernels run here (``VOXPIPE_NATIVE`` not 0, the CPU's flags, a compiler)."""
    return library() is not None


def reset() -> None:
    """Forget the loaded library (or its absence): the next call decides again, reading the
    environment anew (for tests that change ``VOXPIPE_NATIVE`` or the cache)."""
    status.cache_clear()
