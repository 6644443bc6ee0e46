"""``voxpipe bench load``: its arrival process and verdicts (fast), and one tiny real run
(slow): the table comes out and the server's counters equal the benchmark's."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from bench.load import RateRow, Turn, arrivals, holds, pct

ROOT = Path(__file__).resolve().parent.parent


def test_poisson_arrivals_have_the_asked_mean_rate():
    ts = arrivals(2.0, 2000.0, bursty=False, rng=random.Random(1))
    assert ts == sorted(ts) and 0 <= ts[0] and ts[-1] < 2000.0
    assert 3600 < len(ts) < 4400  # 2/s over 2000 s, within ~5 standard deviations


def test_bursty_arrivals_come_four_at_once_at_the_same_mean_rate():
    ts = arrivals(2.0, 2000.0, bursty=True, rng=random.Random(1))
    assert all(ts[i] == ts[i + 1] == ts[i + 2] == ts[i + 3] for i in range(0, len(ts), 4))
    assert 3400 < len(ts) < 4600


def test_a_rate_holds_only_with_nothing_refused_and_99_percent_within_the_slo():
    ok = RateRow(1.0, offered=100, turns=[Turn("answered", 900.0)] * 100, seconds=10)
    assert holds(ok, 2000)
    late = RateRow(1.0, offered=100, turns=[Turn("answered", 900.0)] * 98 + [Turn("answered", 5000.0)] * 2)
    assert not holds(late, 2000)
    refused = RateRow(1.0, offered=100, turns=[Turn("answered", 900.0)] * 99
                      + [Turn("busy:queue", busy_ms=3.0, busy_events=["queue"])])
    assert not holds(refused, 2000) and refused.refused() == {"queue": 1}


def test_percentiles_are_nearest_rank():
    assert pct([5.0, 1.0, 3.0], 0.5) == 3.0 and pct([], 0.5) != pct([], 0.5)  # nan when empty


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_run_prints_the_table_and_the_counters_agree():
    out = subprocess.run([sys.executable, "-m", "cli", "bench", "load", "--rate", "0.3", "--multiples", "1",
                          "--duration", "8", "--llm-table-requests", "2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=850)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| 1× R_sus |")]
    assert len(rows) == 1 and rows[0].rstrip().endswith("| yes |"), out.stdout
    # then voxpipe bench llm's four-row table, on the same machine
    modes = [line.split("|")[1].strip() for line in out.stdout.splitlines() if line.startswith("| ")]
    for mode in ("no batching", "static batch 4", "dynamic batching", "dynamic + int4"):
        assert mode in modes, out.stdout
