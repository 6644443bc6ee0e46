"""bench/llm_quant.py's helpers: prefix agreement, the forced-kernel switch, the table, and the
torchao row (present, absent, or unable to run here: it says why and the bench goes on)."""

from __future__ import annotations

import sys
import types

import torch

from bench import llm_quant
from bench.llm_quant import QualityRow, SpeedRow, forced_quantized, format_tables, prefix_len
from pipeline.llm.runner.quant_linear import quantize_linears


def test_prefix_len_counts_the_common_start():
    assert prefix_len([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert prefix_len([1, 2], [1, 2, 3]) == 2 and prefix_len([], [1]) == 0


def test_forced_quantized_runs_the_kernel_for_wide_steps_and_restores():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)).to(torch.bfloat16)
    quantize_linears(model, "int4", max_rows=8)
    rows = model[0].max_rows
    assert rows == 8
    x = torch.randn(16, 64).to(torch.bfloat16)  # 16 rows: the bf16 copy
    dense = model(x)
    with forced_quantized(model):
        quant = model(x)
    assert not torch.equal(dense, quant) and torch.equal(model(x), dense)
    assert model[0].max_rows == rows


def test_the_tables_print_absent_rows():
    out = format_tables("qwen", {"quality": [QualityRow("cpu", 2, 1.0, 32, 2.0, 1.0)],
                                 "speed": [SpeedRow("llama.cpp", 1, 1, None, None, "absent: no llama_cpp")]})
    assert "LLM=qwen quality" in out and "| cpu | 2 | 1.0 | 32 | 2.0 | 1.0 |" in out
    assert "| llama.cpp | 1 | 1 | absent | absent | absent: no llama_cpp |" in out


def test_the_torchao_row_says_why_it_cannot_run_or_can():
    reason = llm_quant.torchao_missing()  # whichever torchao (or none) this environment has
    assert reason is None or reason.startswith(("absent: pip install -e '.[torchao]'", "torchao ")), reason
    assert reason is None or "\n" not in reason


def test_without_torchao_the_row_is_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    assert llm_quant.torchao_missing().startswith("absent: pip install -e '.[torchao]'")


def test_a_torchao_without_a_cpu_kernel_is_named(monkeypatch):
    fake = types.ModuleType("torchao")
    fake.__version__ = "0.0-test"
    proto = types.ModuleType("torchao.prototype.quantization.int4")
    proto.Int8DynamicActivationInt4WeightConfig = object
    for mod, name in ((fake, "torchao"), (types.ModuleType("p"), "torchao.prototype"),
                      (types.ModuleType("q"), "torchao.prototype.quantization"), (proto, proto.__name__)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert llm_quant.torchao_missing() == ("torchao 0.0-test has no CPU kernel for torchao::da8w4_linear_cpu (a "
                                           "CUDA build, as on PyPI; its CPU build is on PyTorch's own index)")


class _Llm:
    tokenizer = None


def _speed(monkeypatch, torchao_decode=None, missing=None):
    """speed() over fakes: every engine decodes at 10 tok/s × batch, 5 ms a step; torchao's
    layers (:data:`TORCHAO`) run ``torchao_decode`` instead when given."""
    torchao_llm = _Llm()
    monkeypatch.setattr(llm_quant, "_load", lambda name, dev, threads=None: _Llm())
    monkeypatch.setattr(llm_quant, "_load_torchao", lambda name: torchao_llm)
    monkeypatch.setattr(llm_quant, "chat_ids", lambda tok, text: [1, 2])
    monkeypatch.setattr(llm_quant, "torchao_missing", lambda: missing)

    def decode(llm, ids, batch, n):
        if llm is torchao_llm and torchao_decode is not None:
            return torchao_decode(batch)
        return 10.0 * batch, 5.0

    monkeypatch.setattr(llm_quant, "runner_decode", decode)
    return llm_quant.speed("qwen", ["cpu-int4"], [1], [1, 8], ["hi"], 4, None, repeats=1, torchao=True)


def test_the_torchao_rows_stand_beside_voxpipes_int4(monkeypatch):
    rows = _speed(monkeypatch, torchao_decode=lambda b: (7.0 * b, 6.0))
    assert [(r.engine, r.batch, r.tok_s) for r in rows] == [
        ("voxpipe cpu-int4", 1, 10.0), (llm_quant.TORCHAO, 1, 7.0),
        ("voxpipe cpu-int4", 8, 80.0), (llm_quant.TORCHAO, 8, 56.0)]


def test_a_torchao_row_that_cannot_run_says_why_and_the_bench_goes_on(monkeypatch):
    rows = _speed(monkeypatch, missing="absent: pip install -e '.[torchao]' (no torchao)")
    assert [(r.engine, r.batch, r.tok_s, r.note) for r in rows if r.engine == llm_quant.TORCHAO] == [
        (llm_quant.TORCHAO, 1, None, "absent: pip install -e '.[torchao]' (no torchao)"),
        (llm_quant.TORCHAO, 8, None, "absent: pip install -e '.[torchao]' (no torchao)")]
    assert [r.tok_s for r in rows if r.engine != llm_quant.TORCHAO] == [10.0, 80.0]

    def wide_fails(batch):
        if batch == 8:
            raise RuntimeError("da8w4 CPU: no kernel for this shape\nat line 2")
        return 7.0, 6.0

    rows = _speed(monkeypatch, torchao_decode=wide_fails)
    assert {r.note for r in rows if r.engine == llm_quant.TORCHAO} == {
        "decode failed: da8w4 CPU: no kernel for this shape"}
    text = format_tables("qwen", {"speed": rows})
    assert f"| {llm_quant.TORCHAO} | 1 | 8 | absent | absent | decode failed: da8w4 CPU: no kernel for this shape |" \
        in text
