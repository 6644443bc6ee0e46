"""Streaming-ASR benchmark: N sessions on one shared Whisper engine.

N = 1, 2, 4, 8 concurrent sessions each stream the English clips of the test audio
folder (one turn per clip, sessions starting at different clips) in 20 ms frames at
real-time pace into :class:`~pipeline.asr.turn.AsrTurn` drivers on one
:class:`~pipeline.asr.engine.AsrEngine` (in process: no VAD, LLM or TTS competing). Per N it
prints the final-transcript latency after the last audio frame (p50/p95), the interval
between partial transcripts while a clip is playing (mean/p95), the engine's real-time
factor, the mean decode batch, and the WER of the streaming finals next to the WER of
offline ``transcribe()`` (faster-whisper, 30 s windows) of the same clips and model.

Throughput: every decode request the 8-session run made is replayed on the idle engine —
one request per model call, then in arrival-order groups of ``max_batch_size`` (as the
worker batches them) — and requests per second are compared. For reference, every
eighth request is also decoded the stock way, one faster-whisper ``transcribe()`` call
each (30 s window, the committed text as ``initial_prompt``), as a server that runs one
Whisper call per session update would. The share of the one-at-a-time time spent in the
encoder is printed too: the encoder runs per request on CPU (batched encodes were slower
per item), so one-at-a-time time / encoder time bounds what batching can gain there.

Run: ``voxpipe bench asr`` or ``python -m bench.asr`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

RATE = 16000
FRAME = RATE // 50
GAP_S = 0.5
"""Pause between one session's clips (s)."""


@dataclass
class Row:
    sessions: int
    turns: int
    final_p50_ms: float
    final_p95_ms: float
    partial_mean_s: float
    partial_p95_s: float
    rtf: float
    mean_batch: float
    wer_stream: float
    wer_offline: float


@dataclass
class Throughput:
    requests: int
    audio_s: float
    stock_req_s: float
    alone_req_s: float
    batched_req_s: float
    mean_group: float
    encoder_share: float
    ratio: float = field(init=False)
    ratio_stock: float = field(init=False)

    def __post_init__(self) -> None:
        self.ratio = self.batched_req_s / self.alone_req_s
        self.ratio_stock = self.batched_req_s / self.stock_req_s


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def load_clips(audio_dir: Path) -> list[tuple[str, np.ndarray, str]]:
    """(name, 16 kHz float32 audio, reference) of the English clips (not the "hard" ones)."""
    from audio.pcm import resample
    from audio.wav import read_mono

    with open(audio_dir / "manifest.tsv", newline="", encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh, delimiter="\t") if r["language"] == "en" and "hard" not in r["file"]]
    out = []
    for r in rows:
        x, sr = read_mono(audio_dir / r["file"])
        out.append((r["file"], resample(x, sr, RATE).astype(np.float32), r["reference_transcript"]))
    return out


async def _session(engine, clips, first: int, speed: float, stats: dict) -> None:
    from pipeline.asr.turn import AsrTurn

    loop = asyncio.get_running_loop()
    for k in range(len(clips)):
        name, x, _ = clips[(first + k) % len(clips)]
        arrivals: list[float] = []

        async def on_partial(_part, arrivals=arrivals) -> None:
            arrivals.append(loop.time())

        turn = AsrTurn(engine, engine.cfg, language=None, on_partial=on_partial, spawn=asyncio.create_task)
        t0 = loop.time()
        for i in range(0, len(x), FRAME):
            delay = t0 + i / RATE / speed - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            turn.feed(x[i : i + FRAME])
        t_end = loop.time()
        turn.end_input()
        final = await turn.finish()
        stats["latency"].append(loop.time() - t_end)
        stats["finals"].append((name, final.text))
        stats["intervals"] += [b - a for a, b in zip(arrivals, arrivals[1:])]
        await asyncio.sleep(GAP_S / speed)


async def _run(engine, clips, n: int, speed: float) -> dict:
    stats: dict[str, list] = {"latency": [], "finals": [], "intervals": []}
    await asyncio.gather(*(_session(engine, clips, i * len(clips) // max(n, 1), speed, stats) for i in range(n)))
    return stats


def _wer(refs: list[str], hyps: list[str]) -> float:
    import jiwer
    from transformers.models.whisper.english_normalizer import EnglishTextNormalizer

    norm = EnglishTextNormalizer({})
    return float(jiwer.wer([" ".join(norm(r).split()) for r in refs], [" ".join(norm(h).split()) or "-" for h in hyps]))


def streaming_row(engine, clips, n: int, speed: float, offline: dict[str, str], capture: list | None) -> Row:
    """Run ``n`` sessions in real time; one table row."""
    engine.batch_sizes.clear()
    busy0 = engine.busy_s
    if capture is not None:
        engine.capture = capture
    stats = asyncio.run(_run(engine, clips, n, speed))
    engine.capture = None
    refs = {name: ref for name, _, ref in clips}
    names = [name for name, _ in stats["finals"]]
    audio_s = n * sum(len(x) for _, x, _ in clips) / RATE
    return Row(
        sessions=n, turns=len(names),
        final_p50_ms=round(_pct(stats["latency"], 50) * 1000), final_p95_ms=round(_pct(stats["latency"], 95) * 1000),
        partial_mean_s=round(statistics.mean(stats["intervals"]), 2),
        partial_p95_s=round(_pct(stats["intervals"], 95), 2),
        rtf=round((engine.busy_s - busy0) / audio_s, 3),
        mean_batch=round(statistics.mean(engine.batch_sizes), 2) if engine.batch_sizes else 0.0,
        wer_stream=round(100 * _wer([refs[k] for k in names], [t for _, t in stats["finals"]]), 2),
        wer_offline=round(100 * _wer([refs[k] for k in names], [offline[k] for k in names]), 2),
    )


def throughput(engine, requests: list, batch: int, repeats: int = 3) -> Throughput:
    """Replay ``requests`` one per call and in groups of ``batch``, alternating, ``repeats``
    times each; the best time of each counts (other processes on the machine only slow runs)."""
    groups: list[int] = []
    orig = engine.decoder._run_group
    orig_encode = engine.decoder._encode
    enc_s = [0.0]

    def timed_encode(group):
        t = time.perf_counter()
        try:
            return orig_encode(group)
        finally:
            enc_s[0] += time.perf_counter() - t

    def run(size: int) -> float:
        t = time.perf_counter()
        for i in range(0, len(requests), size):
            engine.decode(requests[i : i + size])
        return time.perf_counter() - t

    def spy(group):
        groups.append(len(group))
        return orig(group)

    run(batch)  # warm up
    alone, together = [], []  # alone: (seconds, of which in the encoder)
    for _ in range(repeats):
        enc_s[0] = 0.0
        engine.decoder._encode = timed_encode
        alone.append((run(1), enc_s[0]))
        engine.decoder._encode = orig_encode
        engine.decoder._run_group = spy
        together.append(run(batch))
        engine.decoder._run_group = orig
    audio_s = sum(len(r.audio) for r in requests) / RATE
    return Throughput(len(requests), round(audio_s, 1), round(stock(engine, requests[::8]), 2),
                      round(len(requests) / min(alone)[0], 2), round(len(requests) / min(together), 2),
                      round(statistics.mean(groups), 2), round(min(alone)[1] / min(alone)[0], 2))


def stock(engine, requests: list) -> float:
    """Requests per second decoded one ``WhisperModel.transcribe()`` call each."""
    t = time.perf_counter()
    for r in requests:
        prompt = f"{r.prompt} {r.prefix}".strip() or None
        segments, _ = engine.model.transcribe(r.audio, language=r.language or "en", beam_size=1, temperature=0.0,
                                              initial_prompt=prompt, without_timestamps=True, vad_filter=False,
                                              condition_on_previous_text=False)
        for _ in segments:
            pass
    return len(requests) / (time.perf_counter() - t)


def format_table(rows: list[Row], tp: Throughput | None, head: str) -> str:
    lines = [head, "",
             "| sessions | turns | final p50 ms | final p95 ms | partial every (mean / p95 s) | RTF | mean batch "
             "| WER stream % | WER offline % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.sessions} | {r.turns} | {r.final_p50_ms} | {r.final_p95_ms} | {r.partial_mean_s} / "
                     f"{r.partial_p95_s} | {r.rtf} | {r.mean_batch} | {r.wer_stream} | {r.wer_offline} |")
    if tp is not None:
        lines += ["", "| decode requests (8-session run) | audio s | stock transcribe() req/s "
                  "| one at a time req/s | batched req/s | mean group | batched / one at a time "
                  "| batched / stock | encoder share of one at a time |", "|---|---|---|---|---|---|---|---|---|",
                  f"| {tp.requests} | {tp.audio_s} | {tp.stock_req_s} | {tp.alone_req_s} | {tp.batched_req_s} "
                  f"| {tp.mean_group} | {tp.ratio:.2f}x | {tp.ratio_stock:.2f}x | {tp.encoder_share:.0%} |"]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from pipeline.config import AsrConfig

    server = AsrConfig()
    p.add_argument("--asr-model", default=server.model, help="tiny.en, base or a CTranslate2 Whisper folder")
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--threads", type=int, default=server.threads, help="CTranslate2 threads (the server's budget)")
    p.add_argument("--max-batch-size", type=int, default=server.max_batch_size)
    p.add_argument("--speed", type=float, default=1.0, help="audio pace (1 = real time)")
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    """Run the benchmark and print its table (and JSON with ``--json``)."""
    from pipeline.asr.engine import AsrEngine
    from pipeline.asr.loader import load_whisper
    from pipeline.asr.types import AsrRequest, DecodeRequest
    from pipeline.config import AsrConfig

    cfg = AsrConfig(model=args.asr_model, threads=args.threads, max_batch_size=args.max_batch_size)
    model = load_whisper(cfg)

    class Engine(AsrEngine):
        capture: list | None = None

        def process_batch(self, items):
            if self.capture is not None:
                self.capture += [it for it in items if isinstance(it, DecodeRequest)]
            return super().process_batch(items)

    engine = Engine(model, cfg)
    clips = load_clips(Path(args.audio_dir))
    offline = {name: engine.transcribe(AsrRequest(x)).text for name, x, _ in clips}
    engine.start()
    rows: list[Row] = []
    captured: list = []
    for n in args.sessions:
        rows.append(streaming_row(engine, clips, n, args.speed, offline, captured if n == max(args.sessions) else None))
    engine.stop()
    tp = throughput(engine, captured, args.max_batch_size) if captured else None
    head = (f"ASR streaming — Whisper {args.asr_model} ({model.model.compute_type}, {args.threads} thread(s)), "
            f"max_batch_size {cfg.max_batch_size}, min_chunk {cfg.min_chunk_ms} ms, {len(clips)} English clips "
            f"({sum(len(x) for _, x, _ in clips) / RATE:.0f} s) per session at {args.speed}x real time; "
            f"{os.cpu_count()} CPUs")
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "throughput": asdict(tp) if tp else None}, indent=1))
    else:
        print(format_table(rows, tp, head))
    return 0


if __name__ == "__main__":
    import logging

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level="WARNING")
    parser = argparse.ArgumentParser(prog="python -m bench.asr", description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
