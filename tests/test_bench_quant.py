"""bench/llm_quant.py's helpers: prefix agreement, the forced-kernel switch, the table."""

from __future__ import annotations

import torch

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
