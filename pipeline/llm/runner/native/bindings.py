"""The ctypes signatures of voxpipe's C kernels, in one place.

Each entry mirrors a prototype of ``kernels.h`` (checked by tests/test_native_header.py):
``int`` → ``c_int``, ``int64_t`` → ``c_int64``, ``float`` → ``c_float``, any pointer →
``c_void_p`` (the callers pass ``tensor.data_ptr()`` or None for NULL). ctypes releases the GIL
during each call.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class Signature(NamedTuple):
    """A C function's return type and argument types, as ctypes types."""

    restype: Any
    argtypes: tuple[Any, ...]


SIGNATURES: dict[str, Signature] = {
    # w, sm, x, bias, y, M, N, K, threads, bf16_out
    "q4_gemm": Signature(_i32, (_p, _p, _p, _p, _p, _i32, _i32, _i32, _i32, _i32)),
    # q, q_sb, q_sh, k, k_sb, k_sh, k_st, v, v_sb, v_sh, v_st, starts, ends, out, B, H, KV, T, D, scale, threads
    "attn_decode": Signature(_i32, (_p, _i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _i64, _i64, _p, _p, _p,
                                    _i32, _i32, _i32, _i32, _i32, _f32, _i32)),
    # x, rows, n, stride, out
    "argmax_bf16": Signature(_i32, (_p, _i64, _i64, _i64, _p)),
}
"""Every function of ``kernels.h``, by name."""


def bind(lib: ctypes.CDLL, signatures: dict[str, Signature] | None = None) -> ctypes.CDLL:
    """Set each function's ``restype`` and ``argtypes`` on ``lib`` (:data:`SIGNATURES` unless
    ``signatures`` is given) and return it.

    Raises:
        AttributeError: ``lib`` lacks one of the functions (checked for all before any is
            bound).
    """
    signatures = SIGNATURES if signatures is None else signatures
    fns = {name: getattr(lib, name) for name in signatures}
    for name, sig in signatures.items():
        fns[name].restype = sig.restype
        fns[name].argtypes = sig.argtypes
    return lib
