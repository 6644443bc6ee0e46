"""``voxpipe bench memory`` (bench/memory.py): its ``/metrics`` reading, slope and table on
synthetic readings, and a round of talkers through the server over fake models (fast; the
real run is in docs/BENCHMARKS.md)."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from bench.common import TurnRow, english_clips
from bench.memory import MIB, Reading, _round, format_table, last_half, parts_of, proc_status, slope, smaps_split
from cli.main import build_parser
from tests.fake_server import fake_server

PAGE = """# HELP voxpipe_memory_bytes the server process's resident memory by part
# TYPE voxpipe_memory_bytes gauge
voxpipe_memory_bytes{part="weights_llm"} 2.68435456e+08
voxpipe_memory_bytes{part="kv_used"} 0.0
voxpipe_memory_bytes{part="rest"} 4.194304e+08
voxpipe_process_rss_bytes 6.87865856e+08
"""


def test_the_parts_are_read_from_a_metrics_page():
    assert parts_of(PAGE) == {"weights_llm": 256.0 * MIB, "kv_used": 0.0, "rest": 400.0 * MIB}
    assert parts_of(None) == {} and parts_of("voxpipe_sessions 0\n") == {}


def test_slope_is_the_least_squares_step():
    assert slope([10.0, 12.0, 14.0, 16.0]) == pytest.approx(2.0)
    assert slope([5.0, 7.0, 5.0, 7.0]) == pytest.approx(0.4)
    assert slope([3.0]) == 0.0 and slope([]) == 0.0


def reading(k: int, rest_mb: float) -> Reading:
    parts = {"weights_llm": 256.0 * MIB, "weights_llm_fallback": 0.0, "rest": rest_mb * MIB}
    maps = {"heap": 100.0 * MIB, "arenas": (50 + 18 * k) * MIB, "mmap": 150.0 * MIB, "file": 0.0}
    return Reading(k, sum(parts.values()), parts, {"answered": 3} if k else {}, anon=(300 + 18 * k) * MIB, threads=40,
                   maps=maps)


def test_the_table_has_a_row_per_reading_and_the_last_half_slope():
    readings = [reading(k, 400 + 18 * k) for k in range(7)]  # +18 MB per conversation
    assert [r.conversation for r in last_half(readings)] == [4, 5, 6]
    table = format_table(readings).splitlines()
    # all-zero parts and kinds of mapping left out
    assert table[0] == ("| conversation | RSS MB | weights_llm MB | rest MB | anon MB | heap MB | arenas MB | mmap MB "
                        "| threads | turns |")
    assert table[2] == "| 0 | 656.0 | 256.0 | 400.0 | 300.0 | 100.0 | 50.0 | 150.0 | 40 | - |"
    assert table[-2] == "| 6 | 764.0 | 256.0 | 508.0 | 408.0 | 100.0 | 158.0 | 150.0 | 40 | 3 answered |"
    assert table[-1] == "| slope MB/conv (4-6) | +18.00 | +0.00 | +18.00 | +18.00 | +0.00 | +18.00 | +0.00 | +0.00 | |"
    few = [reading(k, 400) for k in range(3)]
    assert [r.conversation for r in last_half(few)] == [1, 2]


def test_proc_status_and_smaps_read_this_process_and_tolerate_none():
    anon, threads = proc_status(os.getpid())
    assert anon > 0 and threads >= 1
    assert proc_status(None) == (0.0, 0)
    maps = smaps_split(os.getpid())
    assert set(maps) == {"heap", "arenas", "mmap", "file"} and maps["file"] > 0
    assert sum(maps.values()) == pytest.approx(psutil.Process().memory_info().rss, rel=0.1)
    assert smaps_split(None) == {}


def test_the_options_parse():
    args = build_parser().parse_args(["bench", "memory", "--llm", "smollm2", "--conversations", "4",
                                      "--turns-per-conversation", "2"])
    assert (args.bench, args.llm, args.conversations, args.turns_per_conversation) == ("memory", "smollm2", 4, 2)
    assert args.talkers == 1
    assert build_parser().parse_args(["bench", "memory", "--talkers", "4"]).talkers == 4


async def test_a_round_of_talkers_runs_its_conversations_at_once():
    """Two conversations of one real clip each through the real server over fake models: both
    sessions answered, each from its own clip, and they overlapped."""
    clips = english_clips(Path(__file__).parent / "data" / "audio")
    rows: list[TurnRow] = []
    async with fake_server() as srv:
        await _round(srv.ws, clips, 1, 2, 1, 60.0, rows)
    assert sorted(r.session for r in rows) == [1, 2], rows
    assert all(r.outcome == "answered" for r in rows), rows
    assert len({r.clip for r in rows}) == 2, rows
    first, second = sorted(rows, key=lambda r: r.t_s)
    assert second.t_s < first.t_s + 1.0, rows  # both started at once, not one after the other
