"""Building and loading voxpipe's C kernels (pipeline/llm/runner/native/: build.py, cpu.py,
__init__.py): the CPU check, the build cache by source hash and its checksum (a damaged or
truncated library is built again, never loaded), compiler errors, a library missing a
symbol, and the one switch ``VOXPIPE_NATIVE=0`` that turns every kernel off."""

from __future__ import annotations

import logging

import pytest
import torch

from pipeline.llm.runner import greedy, native
from pipeline.llm.runner.native import attn, build, cpu, q4
from pipeline.llm.runner.quant_linear import QuantLinear


@pytest.fixture
def fresh(monkeypatch):
    """The kernels' status decided anew within the test (after its environment changes), and
    again after it with the environment restored."""
    native.reset()
    yield monkeypatch
    monkeypatch.undo()
    native.reset()


def test_cpu_flags_decide_whether_the_kernel_is_used():
    flags = "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl f16c fma"
    assert not cpu.cpu_supported(flags + "\n")
    assert cpu.cpu_supported(flags + " avx512_vnni\n")
    assert not cpu.cpu_supported("processor: 0\n")
    assert cpu.missing_flags(flags + "\n") == ["avx512_vnni"]


@pytest.mark.native
def test_the_build_is_cached_by_source_hash(tmp_path):
    (tmp_path / "q4_vnni-0000000000000000.so").write_bytes(b"an earlier source's build")
    (tmp_path / "kernels-0000000000000000.so").write_bytes(b"another earlier source's build")
    first = build.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    # no temp files left behind: the library and its checksum
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, first.with_suffix(".sha256").name])


@pytest.mark.native
def test_a_changed_header_is_a_new_build(tmp_path, monkeypatch):
    first = build.build(tmp_path)
    header = tmp_path / "kernels.h"
    header.write_text(build.HEADERS[0].read_text() + "\n/* changed */\n")
    monkeypatch.setattr(build, "HEADERS", (header, *build.HEADERS[1:]))
    assert build.build(tmp_path).name != first.name


def test_a_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="compiler"):
        build.build(tmp_path / "cache")


def test_switching_the_kernel_off_falls_back_to_pytorch(fresh):
    fresh.setenv("VOXPIPE_NATIVE", "0")
    native.reset()
    assert not native.available() and native.status().reason == "VOXPIPE_NATIVE=0"
    lin = torch.nn.Linear(64, 32).to(torch.bfloat16)
    ql = QuantLinear(lin, "int4")
    assert not ql.native and "aten" in repr(ql)
    with pytest.raises(RuntimeError, match="not available"):
        q4.gemm(torch.zeros(1, 64), ql.qweight, ql.qscale, 32)


def test_the_switch_turns_off_every_kernel(fresh):
    """``VOXPIPE_NATIVE=0``: attention declines (its caller runs PyTorch's), greedy argmax is
    torch.argmax's, and nothing is built."""
    fresh.setenv("VOXPIPE_NATIVE", "0")
    fresh.setattr(build, "build", lambda *a: pytest.fail("built with VOXPIPE_NATIVE=0"))
    native.reset()
    q = torch.randn(1, 2, 1, 16).bfloat16()
    kv = torch.randn(1, 2, 5, 16).bfloat16()
    assert native.library() is None and attn.attend(q, kv, kv, [0], 0.25) is None
    logits = torch.randn(3, 100).bfloat16()
    assert greedy.argmax(logits) == torch.argmax(logits.float(), dim=-1).tolist()


def test_the_old_switch_is_named_in_a_warning_and_not_read(fresh, caplog):
    on = native.available()
    fresh.setenv("VOXPIPE_NATIVE_INT4", "0")
    native.reset()
    with caplog.at_level(logging.WARNING, logger="pipeline.llm.runner.native"):
        assert native.available() == on
    assert "VOXPIPE_NATIVE_INT4 is no longer read: VOXPIPE_NATIVE=0" in caplog.text


@pytest.mark.native
def test_a_damaged_library_in_the_cache_is_built_again(tmp_path, fresh):
    fresh.setenv("VOXPIPE_KERNEL_CACHE", str(tmp_path))
    lib = build.build()
    lib.write_bytes(lib.read_bytes()[:100])  # truncated
    native.reset()
    assert native.available()
    assert lib.stat().st_size > 100


@pytest.mark.native
def test_a_truncated_library_without_its_checksum_is_never_loaded(tmp_path, monkeypatch):
    # dlopen of a truncated ELF can die of SIGBUS, so the checksum is checked first
    monkeypatch.setenv("VOXPIPE_KERNEL_CACHE", str(tmp_path))
    lib = build.build()
    whole = lib.read_bytes()
    lib.write_bytes(whole[:1000])
    assert build.build() == lib and lib.read_bytes() == whole  # rebuilt, not reused
    assert lib.stat().st_mode & 0o777 == 0o755
    lib.with_suffix(".sha256").unlink()
    build.build()
    assert lib.with_suffix(".sha256").exists()


def test_a_compiler_that_writes_nothing_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "true")  # exits 0, writes nothing
    with pytest.raises(RuntimeError, match="no shared library"):
        build.build(tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.native
def test_cc_may_carry_arguments(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "cc -O2")
    assert build.build(tmp_path).exists()


@pytest.mark.native
def test_a_cached_library_without_a_kernel_symbol_is_not_used(fresh, caplog):
    """A library that loads but lacks ``attn_decode`` (say, a hand-copied build of an older
    source under the current name) makes the kernels unavailable with a warning, not an
    AttributeError from every caller."""
    import ctypes

    class Partial:
        q4_gemm = object()

        def __getattr__(self, name):
            raise AttributeError(f"undefined symbol: {name}")

    fresh.setattr(ctypes, "CDLL", lambda path: Partial())
    native.reset()
    with caplog.at_level("WARNING"):
        assert not native.available()
    assert "undefined symbol: attn_decode" in caplog.text
    fresh.undo()
    native.reset()
    assert native.available()
