"""Where the server process's resident memory goes (``voxpipe_memory_bytes{part}``, issue 37).

The parts add up to the process's RSS by construction: every part but ``rest`` is what
voxpipe knows it holds in host memory, and ``rest`` is RSS minus their sum (never below 0:
were the known parts over RSS, ``rest`` would be 0 and the sum over RSS; see :func:`split_rss`).

=================== ==========================================================================
part                what, and how it is known
=================== ==========================================================================
``runtime``         anonymous memory before any model loaded: the interpreter and the imported
                    libraries' own allocations (importing torch alone takes about 140 MB),
                    measured once when the server starts loading (:func:`anonymous_rss`)
``weights_llm``     the LLM's weights (parameters, buffers, packed copies): tensors' bytes,
                    measured once at load (``MemoryPlan.weights``)
``weights_llm_fallback`` the fallback LLM's, once it has loaded
``weights_asr``     Whisper's ``model.bin`` file size (an estimate: loading tiny.en's 72 MiB
                    file with int8 on CPU added 65 MiB of anonymous memory)
``weights_tts``     the Piper voice's ``.onnx`` file size (an estimate of onnxruntime's copy),
                    or a Coqui model's tensors' bytes (measured)
``weights_vad``     Silero VAD's ``.onnx`` file size (an estimate)
``weights_eot``     the end-of-turn model's ``.onnx`` file size (an estimate)
``kv_used``         KV bytes holding the decoding batch's tokens (each live row's prompt and
                    output tokens × KV bytes per token) and prompts prefilled so far (their
                    tensors' bytes): measured, within a token per row
``kv_reserved``     the rest of the batch's preallocated KV buffers (free slots, padding,
                    spare columns): buffer bytes (measured) − ``kv_used``'s part of them
``prefix_cache``    cached KV blocks: tokens cached × KV bytes per token (each block holds its
                    own copy: measured)
``files``           resident pages of mapped files and shared memory: mostly the shared
                    libraries' code and data (248 MB in a SmolLM2 server, bench memory;
                    psutil's ``shared``, the kernel's count: measured)
``rest``            RSS − the parts above, all anonymous memory grown since the start: the
                    Python heap and sessions, libraries imported while loading, torch's and
                    onnxruntime's/CTranslate2's scratch and arenas, glibc's free-but-kept
                    pages, thread stacks
=================== ==========================================================================

Only host memory counts: a model on a GPU (an LLM with ``--device cuda``, Whisper on CUDA)
gives 0 here for its weights and KV (the GPU's memory is not in RSS). Not the same as
``voxpipe_llm_kv_reserved_bytes``, which is admission's reservation (prompt + max new tokens
per request), not memory allocated.

Pure bookkeeping on numbers and duck-typed engines: no torch import, nothing slow (reading
it is a few attribute reads and one ``/proc/self/statm`` read per scrape).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

PARTS = ("runtime", "weights_llm", "weights_llm_fallback", "weights_asr", "weights_tts", "weights_vad", "weights_eot",
         "kv_used", "kv_reserved", "prefix_cache", "files", "rest")
"""Every part, in the order the gauge and ``bench memory`` list them."""


def split_rss(rss: int, known: Mapping[str, int]) -> dict[str, int]:
    """``known`` parts (bytes, each ≥ 0) and ``rest`` = ``rss`` − their sum, at least 0, so
    the parts sum to ``rss`` whenever the known ones fit in it. Every name of :data:`PARTS`
    is in the result (0 when not known).

    Raises:
        ValueError: a negative ``rss`` or part, or a part not in :data:`PARTS`.
    """
    if rss < 0 or any(v < 0 for v in known.values()):
        raise ValueError(f"rss and parts must be >= 0, got rss {rss}, {dict(known)}")
    unknown = set(known) - set(PARTS[:-1])
    if unknown:
        raise ValueError(f"unknown memory parts {sorted(unknown)}: use {PARTS[:-1]}")
    out = dict.fromkeys(PARTS, 0)
    out.update(known)
    out["rest"] = max(0, rss - sum(known.values()))
    return out


def anonymous_rss() -> int:
    """This process's resident anonymous memory now (bytes): RSS less resident file-backed and
    shared pages (psutil's ``rss - shared``, read from ``/proc/self/statm``; Linux)."""
    import psutil

    m = psutil.Process().memory_info()
    return max(0, m.rss - getattr(m, "shared", 0))


def malloc_free() -> int:
    """Bytes in the free chunks of glibc's malloc heaps, all arenas (``mallinfo2().fordblks``;
    glibc 2.33+); 0 elsewhere. Not a part of :data:`PARTS`: freed memory belongs to whichever
    part allocated it (``rest`` mostly, ``runtime`` too), and a free chunk's pages may or may
    not be resident; ``voxpipe_malloc_free_bytes`` shows what ``malloc_trim`` could at most
    give back. Takes each arena's lock briefly (a walk of its bins)."""
    global _MALLINFO2
    if _MALLINFO2 is None:
        _MALLINFO2 = _load_mallinfo2()
    return 0 if _MALLINFO2 is False else int(_MALLINFO2().fordblks)


_MALLINFO2: Any = None


def _load_mallinfo2() -> Any:
    import ctypes
    import ctypes.util

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return False
    fn.restype, fn.argtypes = Mallinfo2, []
    return fn


def file_bytes(paths: Iterable[str | Path]) -> int:
    """Total size of ``paths`` (bytes); a missing file counts 0 (a model loaded from memory)."""
    total = 0
    for p in paths:
        try:
            total += os.path.getsize(p)
        except OSError:
            pass
    return total


def tensor_bytes(module: Any) -> int:
    """Bytes of a torch module's parameters and buffers, each tensor once (shared ones too)."""
    seen: dict[int, Any] = {}
    for t in (*module.parameters(), *module.buffers()):
        seen.setdefault(id(t), t)
    return sum(t.numel() * t.element_size() for t in seen.values())


def llm_parts(engine: Any, *, prefix: str = "weights_llm") -> dict[str, int]:
    """An in-process LLM engine's host memory: its weights (as ``prefix``), ``kv_used``,
    ``kv_reserved`` and ``prefix_cache`` (bytes). Empty for an engine without a memory
    plan (a remote LLM, a fake) or one on a GPU. Reads the engine thread's state without a
    lock: each read is atomic under the GIL, and a scrape in the middle of a step is at
    most a step off."""
    plan, runner = getattr(engine, "memory", None), getattr(engine, "runner", None)
    if plan is None or runner is None or str(getattr(runner, "device", "cpu")).startswith("cuda"):
        return {}
    used, buffers = runner.kv_bytes(plan.per_token)
    blocks = getattr(runner, "blocks", None)
    return {prefix: plan.weights, "kv_used": used, "kv_reserved": max(0, buffers - used),
            "prefix_cache": 0 if blocks is None else blocks.tokens * plan.per_token}


def measure(rss: int, weights: Mapping[str, int], llm: Any = None, fallback: Any = None, *,
            files: int = 0) -> dict[str, int]:
    """Every part of :data:`PARTS` (bytes) for a process of ``rss`` bytes with ``files``
    bytes of it file-backed or shared: the static ``weights`` the loaders knew
    (``weights_asr``, ``weights_tts``, ...), the LLM engine's and the fallback LLM engine's
    parts (:func:`llm_parts`; None: none), and ``rest``."""
    known = {**weights, "files": files}
    for engine, name in ((llm, "weights_llm"), (fallback, "weights_llm_fallback")):
        if engine is not None:
            for part, n in llm_parts(engine, prefix=name).items():
                known[part] = known.get(part, 0) + n
    return split_rss(rss, known)
