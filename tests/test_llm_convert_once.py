"""Several processes starting on an empty model cache convert an LLM once: the others wait
for its folder (a race between two servers on a fresh machine once failed one of them with
``OSError: Directory not empty`` as both moved their converted copy into place)."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from pipeline.llm import loader


def _fake_convert(gguf: Path, dest: Path) -> None:
    """Stands in for the slow conversion: counts itself, then writes the folder the way
    ``_convert`` does (a temporary folder moved into place)."""
    with open(dest.parent / "conversions.txt", "a") as fh:
        fh.write("1\n")
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir()
    time.sleep(1.0)  # long enough for the other processes to arrive meanwhile
    (tmp / "config.json").write_text("{}")
    tmp.replace(dest)


def _start(cache: str, out: multiprocessing.Queue) -> None:
    import os

    os.environ["VOXPIPE_CACHE"] = cache
    loader._convert = _fake_convert  # type: ignore[assignment]
    loader._gguf_for = lambda name: Path("/nonexistent.gguf")  # type: ignore[assignment]
    try:
        out.put(str(loader.llm_folder("smollm2")))
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put(repr(e))


def test_processes_starting_at_once_convert_once(tmp_path):
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_start, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    dest = tmp_path / "llm" / "smollm2"
    assert results == [str(dest)] * 3
    assert (dest / "config.json").exists()
    assert (tmp_path / "llm" / "conversions.txt").read_text() == "1\n"
