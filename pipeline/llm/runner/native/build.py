"""Compile voxpipe's C kernels into one shared library, cached per user and per source version.

The ``.c`` files of this package (with their headers ``kernels.h`` and ``bf16.h``) are
compiled with the system C compiler (``$CC``, else ``cc`` or ``gcc``) into
``kernels-<hash>.so`` in the cache folder (``$VOXPIPE_KERNEL_CACHE``, default
``~/.cache/voxpipe/kernels``); the hash covers the sources, headers and flags, so an edited
kernel is built again and the older build removed. Beside the library a ``.sha256`` file holds
its checksum, written by the build: a library whose checksum does not match (truncated by a
full disk, a copy cut short) is built again, never loaded.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = (HERE / "q4_vnni.c", HERE / "decode_attn.c", HERE / "argmax.c")
"""Compiled into one library: the int4 GEMM, decode attention and greedy argmax."""
HEADERS = (HERE / "kernels.h", HERE / "bf16.h")
"""Included by the sources: part of the build's hash."""
CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512vnni", "-mf16c", "-mfma", "-Werror=missing-prototypes")
"""The compiler's flags (``-Werror=missing-prototypes``: every exported function is declared
in ``kernels.h``)."""
STEM = "kernels"
"""Library names: ``kernels-<hash>.so``."""
OLD_STEMS = (STEM, "q4_vnni")
"""Names of earlier builds removed from the cache after a build (``q4_vnni``: before the package)."""


def cache_dir() -> Path:
    """``$VOXPIPE_KERNEL_CACHE``, else ``~/.cache/voxpipe/kernels``."""
    return Path(os.environ.get("VOXPIPE_KERNEL_CACHE") or Path.home() / ".cache" / "voxpipe" / "kernels")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(lib: Path) -> bool:
    """True when ``lib`` is the file a build wrote: its sha256 matches the ``.sha256`` file
    written beside it. A truncated library must never reach ``dlopen``: mapping one can
    kill the process with SIGBUS, which no Python handler catches."""
    try:
        return (lib.with_suffix(".sha256").read_text().strip() == _digest(lib))
    except OSError:
        return False


def _compiler() -> list[str]:
    """``$CC`` split into words (it may carry arguments: ``ccache gcc``), else ``cc`` or
    ``gcc`` from ``PATH``; empty when there is none."""
    return shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]


def build(dest_dir: Path | None = None) -> Path:
    """Compile :data:`SOURCES` (once per version of the sources, headers and flags) and return
    the shared library's path.

    A library already in the cache is reused only if it matches the checksum its build
    wrote; otherwise it is built again. Concurrent builders each write their own temporary
    file and rename it into place (atomic).

    Raises:
        RuntimeError: no C compiler, the compiler failed (its stderr in the message) or
            wrote no shared library, or the cache directory is not writable.
    """
    src = b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS))
    tag = hashlib.sha256(src + " ".join(CFLAGS).encode()).hexdigest()[:16]
    dest_dir = dest_dir or cache_dir()
    lib = dest_dir / f"{STEM}-{tag}.so"
    if lib.exists() and _intact(lib):
        return lib
    cc = _compiler()
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) to build voxpipe's kernels")
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest_dir)
    os.close(fd)
    digest = dest_dir / f".{Path(tmp).name}.sha256"
    try:
        try:
            res = subprocess.run([*cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                                 timeout=300)
        except OSError as exc:
            raise RuntimeError(f"the C compiler {cc[0]} could not run: {exc}") from exc
        if res.returncode:
            raise RuntimeError(f"building voxpipe's kernels failed: {res.stderr.strip()[-2000:]}")
        with open(tmp, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise RuntimeError(f"the C compiler {cc[0]} wrote no shared library")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would lock other users of a shared cache out
        digest.write_text(_digest(Path(tmp)))
        os.replace(tmp, lib)
        os.replace(digest, lib.with_suffix(".sha256"))
        for old in (p for stem in OLD_STEMS for p in dest_dir.glob(f"{stem}-*")):  # builds of earlier sources
            if old.stem != lib.stem:
                old.unlink(missing_ok=True)
    finally:
        for leftover in (tmp, str(digest)):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return lib
