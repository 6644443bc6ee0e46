"""``python -m bench.voice_cost``: one configuration measured in a fresh process, and the
table over hand-made runs. Real voices (joe, espeak-ng German); no timing is asserted."""

from __future__ import annotations

import shutil

import pytest

from bench.voice_cost import MIB, run_one, table


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed (.ci/setup.sh)")
def test_one_configuration_loads_each_voice_and_reads_the_rss():
    run = run_one(["en=joe", "de=espeak:de"])
    assert len(run["load_s_each"]) == 2 and all(s > 0 for s in run["load_s_each"])
    assert run["rss_loaded"] > run["rss_base"] > 0 and run["rss_spoken"] > 0 and run["rss_idle"] > 0


def test_the_table_gives_medians_and_the_extra_over_joe():
    def run(loaded_mb: float) -> dict:
        return {"rss_base": 100 * MIB, "rss_loaded": int((100 + loaded_mb) * MIB), "rss_spoken": 300 * MIB,
                "rss_idle": 200 * MIB, "load_s": 1.0, "load_s_each": [1.0]}

    out = table({"joe": [run(90), run(92), run(200)], "joe + x": [run(180)] * 3})
    lines = out.splitlines()
    assert lines[2].startswith("| joe | 1 | 1.00 (1.00) | 92.0 | 200.0 | 100.0 | — |")
    assert lines[3].endswith("| +88.0 / +0.0 / +0.0 |")
