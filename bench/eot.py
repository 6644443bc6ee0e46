"""The end-of-turn model's cost (``voxpipe bench eot``): Smart Turn v3.2 through onnxruntime.

Rows: the model alone on a batch of 1, 4 and 8 turns (ms per batch and per turn, the median
of ``--runs`` runs after one warm-up); the features of one turn (its last 8 s: what every
request costs on top, :mod:`pipeline.eot.features`); and the stage itself
(:class:`~pipeline.eot.stage.EotEngine`) answering 8 requests sent at once, the way the
sessions of a server may, with batches of 1 and of 8: the mean and the last answer's time.
The turns are the repository's English clips. A measurement, not a test: run it on an
otherwise idle machine (well under a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from audio.wav import read_mono
from bench.common import english_clips
from pipeline.config import TurnConfig
from pipeline.eot.features import batch_features, features
from pipeline.eot.loader import EotModel, load_eot_model
from pipeline.eot.stage import EotEngine


@dataclass(slots=True)
class EotRow:
    """One row: ``what`` was timed on ``batch`` turns; the median over the runs (ms)."""

    what: str
    batch: int
    ms: float

    @property
    def ms_per_turn(self) -> float:
        """Milliseconds per turn of the batch."""
        return self.ms / self.batch


def median_ms(call: Callable[[], object], runs: int) -> float:
    """Median wall time of ``runs`` calls of ``call()`` after one warm-up call (ms)."""
    call()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def load_turns(audio_dir: Path, n: int) -> list[np.ndarray]:
    """``n`` turns: the English clips in order, repeated as needed (16 kHz float32)."""
    clips = [read_mono(p)[0] for p in english_clips(audio_dir)]
    return [clips[i % len(clips)] for i in range(n)]


@dataclass(slots=True)
class StageRow:
    """The stage answering ``requests`` turns sent at once with batches of at most
    ``batch_size``: the median over the runs of their mean and of their last answer (ms)."""

    batch_size: int
    requests: int
    mean_ms: float
    last_ms: float


def stage_row(model: EotModel, turns: list[np.ndarray], batch_size: int, runs: int) -> StageRow:
    """:class:`StageRow` of an :class:`EotEngine` with batches of at most ``batch_size``."""
    engine = EotEngine(model, batch_size=batch_size, queue_size=len(turns))
    engine.start()

    async def timed(turn: np.ndarray, t0: float) -> float:
        await engine.run(turn)
        return (time.perf_counter() - t0) * 1000

    async def together() -> list[float]:
        t0 = time.perf_counter()
        return list(await asyncio.gather(*(timed(t, t0) for t in turns)))

    try:
        asyncio.run(together())  # warm-up
        answers = [asyncio.run(together()) for _ in range(runs)]
    finally:
        engine.stop()
    return StageRow(batch_size, len(turns), statistics.median(statistics.fmean(a) for a in answers),
                    statistics.median(max(a) for a in answers))


def measure(model: str, threads: int, batches: list[int], runs: int,
            audio_dir: Path) -> tuple[list[EotRow], list[StageRow]]:
    """The rows (see the module's docstring)."""
    loaded = load_eot_model(model, threads=threads)
    turns = load_turns(audio_dir, max(batches))
    rows = []
    for b in batches:
        feats = batch_features(turns[:b])
        rows.append(EotRow("model", b, median_ms(functools.partial(loaded.predict, feats), runs)))
    rows.append(EotRow("features", 1, median_ms(lambda: features(turns[0]), runs)))
    stage = [stage_row(loaded, turns, b, runs) for b in sorted({1, max(batches)})]
    return rows, stage


def format_table(rows: list[EotRow], stage: list[StageRow], threads: int) -> str:
    """The rows as plain-text tables."""
    lines = [f"Smart Turn v3.2 (onnxruntime, {threads} intra-op thread(s))",
             f"{'what':<10}{'batch':>6}{'ms/batch':>10}{'ms/turn':>9}"]
    lines += [f"{r.what:<10}{r.batch:>6}{r.ms:>10.1f}{r.ms_per_turn:>9.1f}" for r in rows]
    lines += ["", f"the stage, requests sent at once: {'batch size':>10}{'requests':>9}{'mean ms':>9}{'last ms':>9}"]
    lines += [f"{'':<34}{r.batch_size:>10}{r.requests:>9}{r.mean_ms:>9.1f}{r.last_ms:>9.1f}" for r in stage]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``voxpipe bench eot``."""
    p.add_argument("--eot-model", default=TurnConfig().eot_model, help="auto (Smart Turn v3.2) or a local .onnx")
    p.add_argument("--threads", type=int, default=TurnConfig().eot_threads, help="onnxruntime intra-op threads")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8], help="batch sizes (1 4 8)")
    p.add_argument("--runs", type=int, default=7, help="timed runs per row (the median is shown)")
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    """``voxpipe bench eot``: print the table (JSON with ``--json``)."""
    rows, stage = measure(args.eot_model, args.threads, args.batches, args.runs, Path(args.audio_dir))
    if args.json:
        print(json.dumps({"threads": args.threads, "rows": [asdict(r) | {"ms_per_turn": r.ms_per_turn} for r in rows],
                          "stage": [asdict(r) for r in stage]}, indent=1))
    else:
        print(format_table(rows, stage, args.threads))
    return 0
