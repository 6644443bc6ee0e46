"""voxpipe's own int4 CPU GEMM (``q4_vnni.c``): int4 weights × int8 activations on AVX-512 VNNI.

PyTorch's ``_weight_int4pack_mm_for_cpu`` converts every weight to fp32 and multiplies in
fp32, so on this class of CPU it is bound by that arithmetic, not by reading the weights
(1.5× bf16 at batch 1 where the bytes read shrink 3.5×), and it unpacks each weight again
for every block of 4 rows. ``q4_vnni.c`` quantizes the activations per group of 32 to int8
(llama.cpp's Q8_0 scheme) and multiplies with ``vpdpbusd`` (16 outputs × 4 weights per
instruction), unpacking each weight tile once for up to 8 rows.

The C file is compiled on first use with the system C compiler into a per-user cache
(``$VOXPIPE_KERNEL_CACHE``, default ``~/.cache/voxpipe/kernels``, named by the source's hash)
and loaded with :mod:`ctypes` (which releases the GIL during the call). Where the CPU lacks
AVX-512 VNNI/BW or F16C, or no compiler is found, :func:`available` is False and the callers
use PyTorch's kernel.

The same library carries the decode attention kernel (``decode_attn.c``, called through
:mod:`~pipeline.llm.runner.attn_native`) and greedy decoding's argmax (``argmax.c``, through
:mod:`~pipeline.llm.runner.greedy`), so one build, cache and switch serve all three.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4_vnni.c")
SOURCES = (SOURCE, Path(__file__).with_name("decode_attn.c"), Path(__file__).with_name("argmax.c"))
"""Compiled into one library: the int4 GEMM, decode attention (:mod:`~pipeline.llm.runner.attn_native`)
and greedy argmax (:mod:`~pipeline.llm.runner.greedy`)."""
GROUP = 32
"""Weights per scale/min pair along K (fixed in the kernel)."""
TILE = 16
"""Outputs per tile (one 512-bit register of int32 sums)."""
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")
"""``/proc/cpuinfo`` flags the kernel needs."""
CFLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
          "-mavx512vnni", "-mf16c", "-mfma")


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


def cpu_supported(cpuinfo: str | None = None) -> bool:
    """True when the CPU has every flag in :data:`CPU_FLAGS` (read from ``/proc/cpuinfo``
    unless ``cpuinfo`` is given; False where it cannot be read)."""
    return cpu_flags(cpuinfo).issuperset(CPU_FLAGS)


def cache_dir() -> Path:
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


def build(dest_dir: Path | None = None) -> Path:
    """Compile :data:`SOURCES` (once per source version) and return the shared library's path.

    A library already in the cache is reused only if it matches the checksum its build
    wrote; otherwise it is built again. ``$CC`` may carry arguments (``ccache gcc``).

    Raises:
        RuntimeError: no C compiler, the compiler failed (its stderr in the message) or
            wrote no shared library, or the cache directory is not writable.
    """
    src = b"".join(p.read_bytes() for p in SOURCES)
    tag = hashlib.sha256(src + " ".join(CFLAGS).encode()).hexdigest()[:16]
    dest_dir = dest_dir or cache_dir()
    lib = dest_dir / f"q4_vnni-{tag}.so"
    if lib.exists() and _intact(lib):
        return lib
    cc = shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]
    if not cc:
        raise RuntimeError("no C compiler (cc/gcc) to build the int4 kernel")
    dest_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest_dir)
    os.close(fd)
    try:
        try:
            res = subprocess.run([*cc, *CFLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True,
                                 timeout=300)
        except OSError as exc:
            raise RuntimeError(f"the C compiler {cc[0]} could not run: {exc}") from exc
        if res.returncode:
            raise RuntimeError(f"building the int4 kernel failed: {res.stderr.strip()[-2000:]}")
        with open(tmp, "rb") as f:
            if f.read(4) != b"\x7fELF":
                raise RuntimeError(f"the C compiler {cc[0]} wrote no shared library")
        os.chmod(tmp, 0o755)  # mkstemp's 0600 would lock other users of a shared cache out
        digest = dest_dir / f".{Path(tmp).name}.sha256"
        digest.write_text(_digest(Path(tmp)))
        os.replace(tmp, lib)  # atomic: concurrent builders each write their own temp files
        os.replace(digest, lib.with_suffix(".sha256"))
        for old in dest_dir.glob("q4_vnni-*"):  # builds of earlier sources
            if old.stem != lib.stem:
                old.unlink(missing_ok=True)
    finally:
        for leftover in (tmp, str(dest_dir / f".{Path(tmp).name}.sha256")):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return lib


@functools.cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get("VOXPIPE_NATIVE_INT4", "1") == "0" or not cpu_supported():
        return None
    try:
        path = build()
        try:
            lib = ctypes.CDLL(str(path))
        except OSError:  # it passed its checksum but will not load: build it again, once
            path.unlink(missing_ok=True)
            lib = ctypes.CDLL(str(build()))
        fn, at, am = lib.q4_gemm, lib.attn_decode, lib.argmax_bf16  # AttributeError: one is missing
    except (RuntimeError, OSError, AttributeError, subprocess.SubprocessError) as exc:
        logger.warning("int4 kernel unavailable, using PyTorch's: %s", exc)
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
    at.restype = ctypes.c_int
    p, i64, i32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    at.argtypes = (p, i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, p, p, i32, i32, i32, i32, i32, ctypes.c_float,
                   i32)
    am.restype = ctypes.c_int
    am.argtypes = (p, i64, i64, i64, p)
    return lib


def available() -> bool:
    """True when the kernel runs here (CPU flags, a compiler, ``VOXPIPE_NATIVE_INT4`` not 0)."""
    return _library() is not None


def pack(q: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of ``W = q · scale + min``.

    Args:
        q: int ``[N, K]``, values 0..15; N a multiple of 16, K of 32.
        scale, mn: ``[N, K/32]``, any float dtype (stored fp16).

    Returns:
        ``(weights uint8 [N·K/2], scales_and_mins fp16 [N/16 · K/32 · 32])`` (the layout in
        ``q4_vnni.c``'s header).

    Raises:
        ValueError: a shape the kernel does not take.
    """
    n, k = q.shape
    if n % TILE or k % GROUP or scale.shape != (n, k // GROUP) or mn.shape != scale.shape:
        raise ValueError(f"int4 kernel does not take q {tuple(q.shape)}, scales {tuple(scale.shape)}")
    t, g = n // TILE, k // GROUP
    # k = 32 g + 8 p + 4 half + j  ->  [t, g, p, i, j, half]
    v = q.to(torch.uint8).reshape(t, TILE, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    w = (v[..., 0] | (v[..., 1] << 4)).contiguous().reshape(-1)
    sm = torch.stack([scale.to(torch.float16).reshape(t, TILE, g), mn.to(torch.float16).reshape(t, TILE, g)],
                     0)  # [2, t, i, g]
    return w, sm.permute(1, 3, 0, 2).contiguous().reshape(-1)  # [t, g, (scale|min), i]


def gemm(x: torch.Tensor, w: torch.Tensor, sm: torch.Tensor, n: int, *, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype = torch.float32, threads: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias``: ``x`` ``[M, K]`` (taken as contiguous bf16) → ``[M, N]`` in
    ``out_dtype`` (fp32, or bf16 rounded to nearest even).

    Args:
        x: activations; any float dtype (converted to bf16, the kernel's input).
        w, sm: :func:`pack`'s output for an ``[N, K]`` weight.
        n: N.
        bias: fp32 ``[N]`` (made fp32 contiguous) or None.
        out_dtype: ``torch.float32`` or ``torch.bfloat16``.
        threads: OpenMP threads (None: ``torch.get_num_threads()``).

    Raises:
        ValueError: ``x`` not 2-D on the CPU, ``w``/``sm``/``bias`` not :func:`pack`'s output
            for ``[n, K]``, or another ``out_dtype``.
        RuntimeError: the kernel is not available, or it rejected the shapes.
    """
    _entry()
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"int4 kernel writes fp32 or bf16, not {out_dtype}")
    if x.dim() != 2 or any(t.device.type != "cpu" for t in (x, w, sm)):
        raise ValueError(f"int4 kernel takes a 2-D CPU x, got {tuple(x.shape)} on {x.device}")
    if w.dtype != torch.uint8 or sm.dtype != torch.float16 or w.numel() * 2 != n * x.shape[1] or \
            sm.numel() != n * x.shape[1] // GROUP * 2:
        raise ValueError(f"weights packed for another shape than N={n}, K={x.shape[1]}")
    if bias is not None and bias.numel() != n:
        raise ValueError(f"bias of {bias.numel()} for N={n}")
    if x.dtype != torch.bfloat16 or not x.is_contiguous():
        x = x.to(torch.bfloat16).contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.float().contiguous()
    y = torch.empty((x.shape[0], n), dtype=out_dtype)
    gemm_into(w, sm, bias, x, y, x.shape[0], threads)
    return y


def gemm_into(w: torch.Tensor, sm: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, y: torch.Tensor,
              rows: int, threads: int | None = None) -> None:
    """:func:`gemm` without the conversions, for the layers' hot path: ``x`` contiguous bf16
    ``[rows, K]`` (any leading shape), ``y`` contiguous fp32 or bf16 ``[rows, N]`` written in
    place, ``bias`` contiguous fp32 ``[N]`` or None. The caller guarantees dtypes and
    contiguity; shapes are checked by the kernel.

    Raises:
        RuntimeError: the kernel is not available, or it rejected the shapes.
    """
    fn = _entry()
    n, k = y.shape[-1], x.shape[-1]
    if w.numel() * 2 != n * k or x.numel() != rows * k or y.numel() != rows * n:  # cheap: the C code trusts them
        raise RuntimeError(f"int4 kernel: x {tuple(x.shape)}, y {tuple(y.shape)} do not fit "
                           f"weights of {w.numel()} bytes")
    rc = fn(w.data_ptr(), sm.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
            rows, n, k, threads or torch.get_num_threads(), y.dtype is torch.bfloat16)
    if rc:
        raise RuntimeError(f"int4 kernel rejected x {tuple(x.shape)} for N={n}")


def _entry():
    """The kernel's ctypes function.

    Raises:
        RuntimeError: the kernel is not available.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("int4 kernel not available")
    return lib.q4_gemm
