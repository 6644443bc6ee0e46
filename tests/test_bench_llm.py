"""`voxpipe bench llm` end to end on a tiny load: every mode's row is filled in and consistent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bench.llm import format_table, run_mode
from pipeline.config import SchedulerConfig
from pipeline.llm.loader import load_llm


@pytest.fixture(scope="module")
def llm():
    return load_llm("smollm2", device="cpu", threads=1)


@pytest.mark.slow
def test_closed_loop_rows_and_table(llm):
    none = run_mode(llm, "no batching", SchedulerConfig(max_batch_size=1, max_wait_ms=0), "closed c=3", 6, 3, 1.5)
    dyn = run_mode(llm, "dynamic batching", SchedulerConfig(max_batch_size=8, max_wait_ms=50), "closed c=3", 6, 3,
                   1.5)
    for row in (none, dyn):
        assert row.requests == 6 and row.qps > 0 and row.tok_s > 0 and row.steady_tok_s > 0
        assert 0 < row.ttft_p50_ms <= row.ttft_p99_ms <= row.latency_p99_ms
        assert row.peak_mem_mb > 100
    assert none.mean_batch == 1.0 and dyn.mean_batch > 1.0  # three clients share the batch
    table = format_table([none, dyn], SimpleNamespace(llm="smollm2", requests=6, threads=1))
    assert "| dynamic batching | bfloat16 | closed c=3 |" in table
    assert "dynamic batching / closed c=3:" in table and "x tok/s (steady" in table


def test_gpu_utilization_column_only_when_measured():
    from dataclasses import replace

    from bench.llm import Row

    row = Row(mode="dynamic batching", dtype="bfloat16", load="closed c=8", requests=1, qps=1.0, ttft_p50_ms=1,
              ttft_p99_ms=1, latency_p50_ms=1, latency_p99_ms=1, tok_s=1.0, steady_tok_s=1.0, mean_batch=1.0,
              peak_mem_mb=1.0)
    args = SimpleNamespace(llm="smollm2", requests=1, threads=1)
    assert "GPU util" not in format_table([row], args)
    table = format_table([replace(row, gpu_util_pct=87.5)], args)
    assert "GPU util %" in table and "| 87.5 |" in table
