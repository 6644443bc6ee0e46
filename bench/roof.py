"""``voxpipe bench roof``: how close the int4 decode step is to this CPU's limits, and what
that allows continuous batching to gain over batch 1.

A decode step of batch ``b`` is the int4 linears (voxpipe's ``native/q4_vnni.c``) plus everything
else (attention, norms, rotary embeddings, sampling, Python). At batch 1 the kernel reads
every weight once and is bound by memory bandwidth; at batch 8 it multiplies 8 rows per
weight and is bound by the ``vpdpbusd`` instruction (AVX-512 VNNI: 16 lanes × 4 int8
multiply-adds), whose throughput this bench measures with a register-only loop (Intel's and
AMD's optimization manuals give one or two per cycle and core, depending on the core).

For each thread count and batch size the table gives:

* **floor**: the kernel's time if it ran ``vpdpbusd`` at the measured peak and nothing else:
  ``batch × int4 multiply-adds per token / 64 / (instructions per second)``;
* **kernel**: the int4 linears of one step alone, timed over the model's own weights;
* **step**: a whole pure decode step in voxpipe's runner (``bench quant``'s speed rows);

and per thread count the batch-8 over batch-1 token-rate ratio measured, and the ratio if
the batch-8 kernel ran at its floor with the rest of the step unchanged: an upper bound for
what any int4 kernel can give continuous batching at 8 requests on this CPU.
"""

from __future__ import annotations

import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LOOP_C = r"""
#include <immintrin.h>
#include <omp.h>
/* vpdpbusd per second over `threads` threads: 12 independent accumulators per thread (more
 * than the instruction's latency × throughput), registers only. */
double vpdpbusd_rate(int threads, long iters) {
    double t0 = omp_get_wtime();
    volatile int sink = 0;
#pragma omp parallel num_threads(threads)
    {
        __m512i a[12], x = _mm512_set1_epi8(3), y = _mm512_set1_epi8(5);
        for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
        for (long n = 0; n < iters; n++) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
        }
        int s = 0;
        for (int i = 0; i < 12; i++) s += _mm512_reduce_add_epi32(a[i]);
        sink += s;
    }
    return (double)iters * 12 * threads / (omp_get_wtime() - t0);
}
"""
MACS_PER_INSTRUCTION = 64
"""``vpdpbusd`` on 512-bit registers: 16 int32 lanes × 4 byte products."""


@dataclass
class RoofRow:
    threads: int
    batch: int
    giga_vpdpbusd_s: float
    floor_ms: float
    kernel_ms: float
    step_ms: float


def vpdpbusd_rate(threads: int, iters: int = 20_000_000) -> float:
    """Measured ``vpdpbusd`` (zmm) instructions per second over ``threads`` threads (best of 3).

    Raises:
        RuntimeError: no C compiler, or the compiler rejected AVX-512 VNNI.
    """
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc)")
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "roof.c", Path(tmp) / "roof.so"
        src.write_text(LOOP_C)
        res = subprocess.run([cc, "-O3", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vnni",
                              str(src), "-o", str(lib)], capture_output=True, text=True, timeout=120)
        if res.returncode:
            raise RuntimeError(f"building the vpdpbusd loop failed: {res.stderr.strip()[-500:]}")
        fn = ctypes.CDLL(str(lib)).vpdpbusd_rate
        fn.restype, fn.argtypes = ctypes.c_double, [ctypes.c_int, ctypes.c_long]
        return max(fn(threads, iters // 12) for _ in range(3))


def int4_layers(model) -> list:
    """The model's linears on voxpipe's int4 kernel (``QuantLinear`` of kind int4, native)."""
    from pipeline.llm.runner.quant_linear import QuantLinear

    return [m for m in model.modules() if isinstance(m, QuantLinear) and m.kind == "int4" and m.native]


def kernel_ms(layers: list, batch: int, threads: int, repeats: int = 15) -> float:
    """Median time (ms) of one pass of ``batch`` random bf16 rows through every layer's int4
    kernel, as one decode step runs them."""
    import torch

    from pipeline.llm.runner.native import q4

    xs = [torch.randn(batch, m.in_features).bfloat16() for m in layers]
    ys = [torch.empty(batch, m.out_features, dtype=torch.bfloat16) for m in layers]

    def once() -> float:
        t0 = time.perf_counter()
        for m, x, y in zip(layers, xs, ys):
            q4.gemm_into(m.qweight, m.qscale, m.bias_f32, x, y, batch, threads)
        return time.perf_counter() - t0

    once()
    return statistics.median(once() for _ in range(repeats)) * 1000


def ratio_bound(step1_ms: float, step8_ms: float, kernel8_ms: float, floor8_ms: float, batch: int = 8) -> float:
    """Batch-``batch`` over batch-1 token rate if the batch kernel ran at ``floor8_ms`` and the
    rest of its step (``step8_ms - kernel8_ms``) stayed: ``batch × step1 / (rest + floor)``."""
    return batch * step1_ms / (step8_ms - kernel8_ms + floor8_ms)


def measure(name: str, threads: list[int], batches: list[int], tokens: int = 32) -> tuple[list[RoofRow], int]:
    """The table's rows and the model's int4 multiply-adds per token."""
    import torch

    from bench.llm_quant import chat_ids, runner_decode
    from bench.prompts import load_prompts
    from pipeline.cpu_share import in_own_thread_sync
    from pipeline.llm.loader import load_llm

    llm = in_own_thread_sync(load_llm, name, device="cpu-int4")
    layers = int4_layers(llm.model)
    if not layers:
        raise RuntimeError("no linear layer runs voxpipe's int4 kernel here (no AVX-512 VNNI, or "
                           "VOXPIPE_NATIVE=0)")
    macs = sum(m.in_features * m.out_features for m in layers)
    ids = [chat_ids(llm.tokenizer, p.text) for p in load_prompts()[:8]]
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        rate = vpdpbusd_rate(t)
        runner_decode(llm, ids, 1, 4)  # warm-up
        for b in batches:
            step = statistics.median(runner_decode(llm, ids, b, tokens)[1] for _ in range(3))
            rows.append(RoofRow(t, b, round(rate / 1e9, 2), round(b * macs / MACS_PER_INSTRUCTION / rate * 1000, 2),
                                round(kernel_ms(layers, b, t), 2), round(step, 1)))
    return rows, macs


def format_table(rows: list[RoofRow], name: str, macs: int) -> str:
    lines = [f"LLM={name}: {macs / 1e6:.1f} M int4 multiply-adds per token on voxpipe's kernel",
             "| threads | batch | G vpdpbusd/s | kernel floor ms | kernel ms (floor %) | step ms |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.threads} | {r.batch} | {r.giga_vpdpbusd_s} | {r.floor_ms} | "
                     f"{r.kernel_ms} ({100 * r.floor_ms / r.kernel_ms:.0f} %) | {r.step_ms} |")
    for t in sorted({r.threads for r in rows}):
        one = next((r for r in rows if r.threads == t and r.batch == 1), None)
        for r in (r for r in rows if r.threads == t and r.batch > 1):
            if one is None:
                continue
            lines.append(f"threads {t}, batch {r.batch} over batch 1: {r.batch * one.step_ms / r.step_ms:.2f}x "
                         f"token rate measured; at most "
                         f"{ratio_bound(one.step_ms, r.step_ms, r.kernel_ms, r.floor_ms, r.batch):.2f}x with the "
                         f"batch kernel at its floor")
    return "\n".join(lines)


def add_arguments(p) -> None:
    """The options of ``voxpipe bench roof``."""
    p.add_argument("--llm", default="qwen")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--json", action="store_true")


def main(args) -> int:
    """``voxpipe bench roof``: print the table (JSON with ``--json``)."""
    import json

    rows, macs = measure(args.llm, args.threads, args.batches)
    if args.json:
        print(json.dumps({"int4_macs_per_token": macs, "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(format_table(rows, args.llm, macs))
    return 0
