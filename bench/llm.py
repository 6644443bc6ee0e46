"""LLM serving benchmark: the batching table for voxpipe's own engine (docs/BENCHMARKS.md).

Modes: no batching (one request at a time), static batching (batches of
4 that wait until full and admit nobody while running), dynamic/continuous batching
(``max_wait_ms=50``), and dynamic batching at the other CPU precision: with ``--device cpu``
the first three rows are bf16 and the last is int4 (weight-only int4 linears); with
``--device cpu-int4`` (the CPU serving default) the first three are int4 and the last bf16.
Loads: a closed loop at fixed concurrency, and Poisson arrivals at a fixed rate.
Chat prompts of varied length with varied
``max_new_tokens``; every request uses the chat template's default system prompt, as chat
requests share one system prompt in serving.

A run is finite: at its end the batch drains (the last requests decode in a shrinking
batch; at 72 requests and concurrency 8 that tail is ~35 of ~270 steps at a mean batch of
~4). So there are two throughputs: ``tok/s`` over the whole run, and ``steady tok/s`` over
the window from the start to the last request's submission, while every client still had a
request in flight (for Poisson load: while requests still arrived). Tokens are counted per
engine step (``LlmEngine.stats.token_log``). No batching has no drain, so its two agree; the
target "at concurrency 8" is read on the steady column. The no-batching Poisson rows are
overloaded at 1.5 req/s (capacity is ~0.8 req/s), so their latency grows with the run length.
Memory: peak RSS on CPU (VmHWM, reset per row), peak allocated GPU memory on CUDA, where a
``GPU util %`` column (NVML, sampled every 100 ms) is added.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import threading
import time
from dataclasses import asdict, dataclass

from tqdm import tqdm

PROMPTS = [
    "What is the capital of France?",
    "Give me one tip for sleeping better.",
    "Explain in two sentences why the sky is blue.",
    "What should I cook tonight with rice, eggs and spinach?",
    "Tell me a short fun fact about octopuses.",
    "How far is the Moon from the Earth, roughly?",
    "Suggest a name for a small grey cat.",
    "I have a meeting at nine tomorrow and a dentist appointment at two; remind me what to prepare.",
    "What is the difference between weather and climate? Keep it short.",
    "Translate 'good morning, how are you' into Spanish.",
    "Why do leaves change colour in autumn?",
    "Recommend a classic novel and say why in one sentence.",
]
MAX_NEW = [24, 32, 48]


@dataclass
class Row:
    mode: str
    dtype: str
    load: str
    requests: int
    qps: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    tok_s: float
    steady_tok_s: float
    mean_batch: float
    peak_mem_mb: float
    gpu_util_pct: float | None = None


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def _reset_peak_memory(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # Linux: reset the peak RSS (VmHWM)
        except OSError:
            pass


class _GpuUtilization:
    """Mean GPU utilization (%) over a run, sampled every 100 ms with
    ``torch.cuda.utilization`` (NVML through pynvml); None off CUDA or without NVML."""

    def __init__(self, device) -> None:
        self.device = device
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True) if device.type == "cuda" else None

    def _run(self) -> None:
        import torch

        while not self._stop.wait(0.1):
            try:
                self.samples.append(float(torch.cuda.utilization(self.device)))
            except Exception:  # noqa: BLE001 - no NVML: report nothing
                return

    def __enter__(self) -> _GpuUtilization:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return round(statistics.mean(self.samples), 1) if self.samples else None


def _peak_memory_mb(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _workload(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [(PROMPTS[i % len(PROMPTS)], rng.choice(MAX_NEW)) for i in range(n)]


async def _one(engine, prompt: str, max_new: int, results: list) -> None:
    from pipeline.llm.types import GenRequest

    t0 = time.perf_counter()
    stream = engine.submit(GenRequest(messages=[{"role": "user", "content": prompt}], max_new_tokens=max_new))
    async for _ in stream:
        pass
    results.append((stream.stats.ttft_ms, (time.perf_counter() - t0) * 1000, stream.stats.output_tokens, t0))


async def _closed_loop(engine, work, concurrency: int, bar) -> list:
    results: list = []
    it = iter(work)

    async def worker() -> None:
        for prompt, n in it:
            await _one(engine, prompt, n, results)
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _poisson(engine, work, rate: float, bar, seed: int = 1) -> list:
    rng = random.Random(seed)
    results: list = []
    tasks = []
    for prompt, n in work:
        tasks.append(asyncio.create_task(_one(engine, prompt, n, results)))
        tasks[-1].add_done_callback(lambda _: bar.update())
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    return results


def run_mode(llm, mode: str, sched, load: str, n: int, concurrency: int, rate: float) -> Row:
    """Run one mode under one load; returns its table row."""
    from pipeline.config import LlmConfig
    from pipeline.llm.engine import LlmEngine

    engine = LlmEngine(llm, LlmConfig(queue_size=max(64, n)), sched)
    engine.start()
    try:
        asyncio.run(_closed_loop(engine, [("Hi", 4)], 1, tqdm(disable=True)))  # warm-up
        engine.stats.batch_sizes.clear()
        engine.stats.token_log.clear()
        _reset_peak_memory(llm.device)
        work = _workload(n)
        with tqdm(total=n, desc=f"{mode} / {load}", unit="req", leave=False) as bar, \
                _GpuUtilization(llm.device) as gpu:
            t0 = time.perf_counter()
            if load.startswith("closed"):
                results = asyncio.run(_closed_loop(engine, work, concurrency, bar))
            else:
                results = asyncio.run(_poisson(engine, work, rate, bar))
            wall = time.perf_counter() - t0
    finally:
        engine.stop()
    ttft = [r[0] for r in results]
    lat = [r[1] for r in results]
    toks = sum(r[2] for r in results)
    # steady state: from the start to the last submission (all clients / arrivals still active)
    last = max(r[3] for r in results) - t0
    steady = sum(k for t, k in engine.stats.token_log if t <= t0 + last) / last if last > 1 else toks / wall
    return Row(mode=mode, dtype=str(llm.dtype).replace("torch.", ""), load=load, requests=n,
               qps=round(n / wall, 3), ttft_p50_ms=round(_pct(ttft, 50)), ttft_p99_ms=round(_pct(ttft, 99)),
               latency_p50_ms=round(_pct(lat, 50)), latency_p99_ms=round(_pct(lat, 99)),
               tok_s=round(toks / wall, 1), steady_tok_s=round(steady, 1),
               mean_batch=round(statistics.mean(engine.stats.batch_sizes), 2) if engine.stats.batch_sizes else 0.0,
               peak_mem_mb=round(_peak_memory_mb(llm.device), 1), gpu_util_pct=gpu.mean)


def main(args) -> int:
    """``voxpipe bench llm``: print the table (and JSON with ``--json``)."""
    import torch

    from pipeline.config import SchedulerConfig
    from pipeline.cpu_share import in_own_thread_sync
    from pipeline.llm.loader import load_llm

    torch.set_num_threads(args.threads)
    # the last row: the other CPU precision beside the table's (cuda: the same, once more)
    base_dev, last_dev, last_mode = {"cuda": ("cuda", "cuda", "dynamic (bf16)"),
                                     "cpu-int4": ("cpu-int4", "cpu", "dynamic (bf16)"),
                                     }.get(args.device, ("cpu", "cpu-int4", "dynamic + int4"))
    modes = [
        ("no batching", base_dev, SchedulerConfig(max_batch_size=1, max_wait_ms=0)),
        ("static batch 4", base_dev, SchedulerConfig(max_batch_size=4, max_wait_ms=2000, static=True)),
        ("dynamic batching", base_dev, SchedulerConfig(max_batch_size=args.max_batch_size, max_wait_ms=50)),
        (last_mode, last_dev, SchedulerConfig(max_batch_size=args.max_batch_size, max_wait_ms=50)),
    ]
    loads = [f"closed c={args.concurrency}", f"poisson {args.rate}/s"]
    rows: list[Row] = []
    rounds: list[tuple[Row, Row]] = []
    models: dict = {}
    for mode, dev, sched in modes:
        if dev not in models:
            models.clear()
            # in a thread that ends: a live thread's OpenMP team would throttle the engine's
            models[dev] = in_own_thread_sync(load_llm, args.llm, device=dev, threads=args.threads)
        for load in loads:
            rows.append(run_mode(models[dev], mode, sched, load, args.requests, args.concurrency, args.rate))
            if dev == "cpu-int4":
                rows[-1].dtype = "int4 weights"
        if mode == "dynamic batching" and getattr(args, "rounds", 0):
            rounds = run_rounds(models[dev], modes[0][2], sched, args.rounds, args.requests, args.concurrency)
    if args.json:
        table = [asdict(r) for r in rows]
        print(json.dumps({"rows": table, "rounds": [[asdict(a), asdict(b)] for a, b in rounds]} if rounds else table,
                         indent=1))
    else:
        print(format_table(rows, args))
        if rounds:
            print(format_rounds(rounds))
    return 0


def run_rounds(llm, alone, batched, n_rounds: int, n: int, concurrency: int) -> list[tuple[Row, Row]]:
    """The closed loop's batching ratio measured in turns: ``n_rounds`` × (no batching, then
    continuous batching), each a fresh :func:`run_mode` of ``n`` requests at ``concurrency``.

    The machine's speed drifts between minutes (here batch-1 decode moved by a third within
    an hour), and batch 1 (memory-bound) drifts more than batch 8 (compute-bound), so one
    pair of rows measured minutes apart gives a ratio that moves with the drift; pairs in
    turns, with the median of their ratios, move less (as ``bench quant``'s repeats).

    Returns:
        ``[(no batching row, continuous batching row), ...]``, one pair per round.
    """
    load = f"closed c={concurrency}"
    return [(run_mode(llm, "no batching", alone, load, n, concurrency, 0.0),
             run_mode(llm, "dynamic batching", batched, load, n, concurrency, 0.0)) for _ in range(n_rounds)]


def format_rounds(rounds: list[tuple[Row, Row]]) -> str:
    """A row per round (tok/s of each mode, the ratio over the whole run and over its steady
    window) and the medians of the ratios."""
    lines = [f"rounds in turns, {rounds[0][0].load}, {rounds[0][0].requests} requests each:",
             "| round | no batching tok/s | continuous tok/s | ratio | steady ratio |", "|---|---|---|---|---|"]
    ratios, steadies = [], []
    for i, (a, b) in enumerate(rounds, 1):
        ratios.append(b.tok_s / a.tok_s)
        steadies.append(b.steady_tok_s / a.steady_tok_s)
        lines.append(f"| {i} | {a.tok_s} | {b.tok_s} | {ratios[-1]:.2f}x | {steadies[-1]:.2f}x |")
    lines.append(f"continuous batching over no batching, median of {len(rounds)} rounds: "
                 f"{statistics.median(ratios):.2f}x tok/s (steady {statistics.median(steadies):.2f}x)")
    return "\n".join(lines)


def format_table(rows: list[Row], args) -> str:
    gpu = any(r.gpu_util_pct is not None for r in rows)
    head = ["mode", "dtype", "load", "QPS", "TTFT p50", "TTFT p99", "lat p50", "lat p99", "tok/s",
            "steady tok/s", "batch", "peak MB"] + (["GPU util %"] if gpu else [])
    lines = [f"LLM={args.llm} requests={args.requests} threads={args.threads} (ms unless noted)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(v) for v in (
            r.mode, r.dtype, r.load, r.qps, r.ttft_p50_ms, r.ttft_p99_ms, r.latency_p50_ms, r.latency_p99_ms,
            r.tok_s, r.steady_tok_s, r.mean_batch, r.peak_mem_mb) + ((r.gpu_util_pct,) if gpu else ())) + " |")
    base = {r.load: r for r in rows if r.mode == "no batching"}
    for r in rows:
        if r.mode != "no batching" and r.load in base:
            b = base[r.load]
            steady = r.steady_tok_s / b.steady_tok_s
            lines.append(f"{r.mode} / {r.load}: {r.tok_s / b.tok_s:.2f}x tok/s (steady {steady:.2f}x), "
                         f"p99 latency {r.latency_p99_ms / b.latency_p99_ms:.2f}x of no batching")
    return "\n".join(lines)
