"""The ctypes bindings of voxpipe's C kernels (pipeline/llm/runner/native/bindings.py) against
the C prototypes in kernels.h: the same functions, argument counts and types, return types.
A binding that drifts from its C function passes wrong bits at run time (a 32-bit stride
where C reads 64, a pointer taken as an int), which no kernel test need catch, so this one
compares them statically: no compiler, no library."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from pipeline.llm.runner.native import bindings
from pipeline.llm.runner.native.bindings import Signature

NATIVE = Path(bindings.__file__).parent
HEADER = NATIVE / "kernels.h"

C_TYPES = {"void": None, "int": ctypes.c_int, "unsigned int": ctypes.c_uint, "int32_t": ctypes.c_int32,
           "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64, "uint64_t": ctypes.c_uint64,
           "long": ctypes.c_long, "size_t": ctypes.c_size_t, "float": ctypes.c_float, "double": ctypes.c_double,
           "uint8_t": ctypes.c_uint8, "uint16_t": ctypes.c_uint16, "char": ctypes.c_char}
"""C scalar types and the ctypes type that passes each (``void``: no return value)."""
QUALIFIERS = {"const", "volatile", "restrict", "extern"}
PROTOTYPE = re.compile(r"([A-Za-z_][\w\s]*?[\s*]+)([A-Za-z_]\w*)\s*\(([^()]*)\)\s*;")


def parse_prototypes(text: str) -> dict[str, tuple[str, list[str]]]:
    """``name -> (return type, [argument type, ...])`` of every function prototype in C header
    text (comments and preprocessor lines ignored). Types are normalized: qualifiers dropped,
    words joined by one space, a ``*`` per level of pointer (``const uint16_t *q`` →
    ``uint16_t*``); ``(void)`` is no argument.

    Raises:
        ValueError: an argument without a name (this header names every one).
    """
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    out: dict[str, tuple[str, list[str]]] = {}
    for m in PROTOTYPE.finditer(text):
        ret, name, args = m.group(1), m.group(2), m.group(3).strip()
        params = [] if args in ("", "void") else [_param(a, name) for a in args.split(",")]
        out[name] = (_type(ret), params)
    return out


def _type(decl: str) -> str:
    words = [w for w in re.findall(r"[A-Za-z_]\w*", decl) if w not in QUALIFIERS]
    return " ".join(words) + "*" * decl.count("*")


def _param(decl: str, fn: str) -> str:
    words = [w for w in re.findall(r"[A-Za-z_]\w*", decl) if w not in QUALIFIERS]
    if len(words) < 2:
        raise ValueError(f"{fn}: argument {decl.strip()!r} has no name")
    return _type(decl.rsplit(words[-1], 1)[0] + "*" * decl.rsplit(words[-1], 1)[1].count("*"))


def _matches(c_type: str, ct) -> bool:
    """True when ctypes type ``ct`` passes C type ``c_type`` (any pointer: ``c_void_p``,
    ``c_char_p`` or a ``POINTER`` to the pointee's type)."""
    if c_type.endswith("*"):
        if ct in (ctypes.c_void_p, ctypes.c_char_p):
            return True
        return isinstance(ct, type) and issubclass(ct, ctypes._Pointer) and _matches(c_type[:-1], ct._type_)
    return c_type in C_TYPES and C_TYPES[c_type] is ct


def _name(ct) -> str:
    return "None" if ct is None else ct.__name__


def mismatches(header: str, signatures: dict[str, Signature]) -> list[str]:
    """Every difference between the prototypes in ``header`` (C text) and ``signatures``
    (:data:`bindings.SIGNATURES`' shape), one line each; empty when they agree."""
    protos = parse_prototypes(header)
    out = [f"{n}: in kernels.h, not bound" for n in sorted(protos.keys() - signatures.keys())]
    out += [f"{n}: bound, not in kernels.h" for n in sorted(signatures.keys() - protos.keys())]
    for name in sorted(protos.keys() & signatures.keys()):
        (ret, args), sig = protos[name], signatures[name]
        if not _matches(ret, sig.restype):
            out.append(f"{name}: returns {ret} in kernels.h, restype {_name(sig.restype)}")
        if len(args) != len(sig.argtypes):
            out.append(f"{name}: {len(args)} arguments in kernels.h, {len(sig.argtypes)} argtypes")
            continue
        out += [f"{name}: argument {i} is {c} in kernels.h, argtype {_name(ct)}"
                for i, (c, ct) in enumerate(zip(args, sig.argtypes)) if not _matches(c, ct)]
    return out


def test_every_binding_matches_its_prototype():
    assert mismatches(HEADER.read_text(), bindings.SIGNATURES) == []


def test_the_header_declares_every_kernel():
    protos = parse_prototypes(HEADER.read_text())
    assert set(protos) == {"q4_gemm", "attn_decode", "argmax_bf16"}
    assert len(protos["attn_decode"][1]) == 21 and protos["attn_decode"][1][1] == "int64_t"
    assert protos["q4_gemm"] == ("int", ["uint8_t*", "uint16_t*", "uint16_t*", "float*", "void*"] + ["int"] * 5)


def test_every_source_includes_the_header():
    # so the compiler checks each definition against its prototype
    for src in sorted(NATIVE.glob("*.c")):
        assert re.search(r'^#include "kernels\.h"', src.read_text(), re.M), src.name


def test_every_exported_definition_is_declared():
    # a function defined without `static` is exported: it must be in kernels.h (the build's
    # -Werror=missing-prototypes says the same at compile time)
    protos = parse_prototypes(HEADER.read_text())
    defined = {m.group(1) for src in NATIVE.glob("*.c")
               for m in re.finditer(r"^(?!static\b)[A-Za-z_][\w\s*]*?\b([A-Za-z_]\w*)\s*\([^;{]*\)\s*\{",
                                    src.read_text(), re.M)}
    assert defined == set(protos)


def _drifted(name: str, change) -> dict[str, Signature]:
    sigs = dict(bindings.SIGNATURES)
    sig = sigs[name]
    sigs[name] = Signature(sig.restype, tuple(change(list(sig.argtypes))))
    return sigs


@pytest.mark.parametrize(("name", "change", "report"), [
    ("attn_decode", lambda a: a[:5] + [ctypes.c_int] + a[6:], "attn_decode: argument 5 is int64_t in kernels.h, "
                                                              "argtype c_int"),
    ("attn_decode", lambda a: a[:-1], "attn_decode: 21 arguments in kernels.h, 20 argtypes"),
    ("q4_gemm", lambda a: [ctypes.c_int64] + a[1:], "q4_gemm: argument 0 is uint8_t* in kernels.h, argtype c_long"),
    ("argmax_bf16", lambda a: a[:1] + [ctypes.c_int] + a[2:], "argmax_bf16: argument 1 is int64_t in kernels.h, "
                                                              "argtype c_int"),
    ("attn_decode", lambda a: a[:19] + [ctypes.c_double] + a[20:], "attn_decode: argument 19 is float in "
                                                                    "kernels.h, argtype c_double"),
])
def test_a_drifted_binding_is_reported(name, change, report):
    found = mismatches(HEADER.read_text(), _drifted(name, change))
    assert found == [report.replace("c_long", ctypes.c_int64.__name__)]


def test_a_missing_or_extra_function_or_a_wrong_return_type_is_reported():
    header = HEADER.read_text()
    sigs = dict(bindings.SIGNATURES)
    del sigs["argmax_bf16"]
    assert mismatches(header, sigs) == ["argmax_bf16: in kernels.h, not bound"]
    sigs = {**bindings.SIGNATURES, "gone": Signature(ctypes.c_int, ())}
    assert mismatches(header, sigs) == ["gone: bound, not in kernels.h"]
    sigs = {**bindings.SIGNATURES, "q4_gemm": Signature(None, bindings.SIGNATURES["q4_gemm"].argtypes)}
    assert mismatches(header, sigs) == ["q4_gemm: returns int in kernels.h, restype None"]


def test_the_parser_reads_pointers_qualifiers_and_void():
    text = """/* a comment with int fake(int x); inside */
    #include <stdint.h>
    // int also_fake(void);
    void reset(void);
    const float **table(const int64_t *restrict rows, unsigned int n, double scale);
    """
    assert parse_prototypes(text) == {"reset": ("void", []),
                                      "table": ("float**", ["int64_t*", "unsigned int", "double"])}
    assert _matches("int64_t*", ctypes.POINTER(ctypes.c_int64)) and not _matches("int64_t*", ctypes.POINTER(
        ctypes.c_int32))
    assert _matches("float*", ctypes.c_void_p) and not _matches("float", ctypes.c_void_p)
    with pytest.raises(ValueError, match="no name"):
        parse_prototypes("int f(int);")
