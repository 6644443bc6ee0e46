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


def _row(mode: str, tok_s: float, steady: float):
    from bench.llm import Row

    return Row(mode=mode, dtype="bfloat16", load="closed c=8", requests=72, qps=1.0, ttft_p50_ms=1, ttft_p99_ms=1,
               latency_p50_ms=1, latency_p99_ms=1, tok_s=tok_s, steady_tok_s=steady, mean_batch=1.0,
               peak_mem_mb=1.0)


def test_rounds_table_gives_each_ratio_and_their_median():
    from bench.llm import format_rounds

    rounds = [(_row("no batching", 40.0, 40.0), _row("dynamic batching", 200.0, 210.0)),
              (_row("no batching", 60.0, 60.0), _row("dynamic batching", 210.0, 216.0)),
              (_row("no batching", 50.0, 50.0), _row("dynamic batching", 220.0, 225.0))]
    text = format_rounds(rounds)
    assert "| 1 | 40.0 | 200.0 | 5.00x | 5.25x |" in text
    assert "| 2 | 60.0 | 210.0 | 3.50x | 3.60x |" in text
    assert "| 3 | 50.0 | 220.0 | 4.40x | 4.50x |" in text
    assert text.endswith("median of 3 rounds: 4.40x tok/s (steady 4.50x)")


@pytest.mark.slow
def test_rounds_alternate_the_two_modes(llm):
    from bench.llm import run_rounds

    rounds = run_rounds(llm, SchedulerConfig(max_batch_size=1, max_wait_ms=0),
                        SchedulerConfig(max_batch_size=8, max_wait_ms=50), 2, 4, 2)
    assert len(rounds) == 2
    for alone, batched in rounds:
        assert (alone.mode, batched.mode) == ("no batching", "dynamic batching")
        assert alone.load == batched.load == "closed c=2" and alone.requests == batched.requests == 4
        assert alone.mean_batch == 1.0 and batched.mean_batch > 1.0 and alone.tok_s > 0 and batched.tok_s > 0
