"""`voxpipe bench roof`: the vpdpbusd floor of an int4 step and the ratio bound it implies."""

from __future__ import annotations

import pytest

from bench.roof import MACS_PER_INSTRUCTION, RoofRow, format_table, measure, ratio_bound


def test_ratio_bound_replaces_the_batch_kernel_by_its_floor():
    # batch 1: 12 ms a step; batch 8: 25 ms, of which the kernel is 14 ms with a 9 ms floor
    assert ratio_bound(12.0, 25.0, 14.0, 9.0) == pytest.approx(8 * 12 / 20)
    assert ratio_bound(12.0, 25.0, 14.0, 14.0) == pytest.approx(8 * 12 / 25)  # at the floor already: measured


def test_table_gives_floor_share_measured_ratio_and_bound():
    rows = [RoofRow(2, 1, 7.0, 0.5, 3.0, 12.0), RoofRow(2, 8, 7.0, 4.0, 8.0, 24.0)]
    text = format_table(rows, "qwen", 494_000_000)
    assert "494.0 M int4 multiply-adds per token" in text
    assert "| 2 | 8 | 7.0 | 4.0 | 8.0 (50 %) | 24.0 |" in text
    assert "threads 2, batch 8 over batch 1: 4.00x token rate measured; at most 4.80x" in text


@pytest.mark.native
@pytest.mark.slow
def test_measure_counts_every_int4_weight_and_floors_by_the_measured_rate():
    rows, macs = measure("smollm2", [1], [1, 2], tokens=6)
    # SmolLM2-135M: 30 layers of q/o 576x576, k/v 576x192, gate/up/down 576x1536
    assert macs >= 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert [(r.threads, r.batch) for r in rows] == [(1, 1), (1, 2)]
    for r in rows:
        assert r.giga_vpdpbusd_s > 0 and r.kernel_ms > 0 and r.step_ms > 0
        expected = r.batch * macs / MACS_PER_INSTRUCTION / (r.giga_vpdpbusd_s * 1e9) * 1000
        assert r.floor_ms == pytest.approx(expected, rel=0.01, abs=0.01)  # the rate is rounded to 0.01 G
