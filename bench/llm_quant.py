"""``voxpipe bench quant``: weight-only quantized LLM decode against bf16 and llama.cpp (issue 16).

Two tables:

* **quality** (``--what quality``): on the fixed prompt set (``bench/prompts.tsv``, each
  prompt as one user turn through the chat template), the bf16 model's greedy first
  ``--tokens`` (32) tokens against each quantized device's: the share of prompts whose
  tokens are all identical, the mean length of the matching prefix, and the perplexity of
  the bf16-generated continuation under each model (teacher forcing, one forward over
  prompt + continuation with the quantized kernel forced for every row:
  :func:`forced_quantized`), with its ratio to bf16's own.
* **speed** (``--what speed``): decode tokens/s of voxpipe's runner (continuous-batching
  ``ModelRunner``: ``--batches`` requests decoding together, pure decode steps only, prefill
  excluded) per device, and llama.cpp's (llama-cpp-python, the ``[llamacpp]`` extra) on the
  model's own GGUF at the same thread count, batch 1 only (its ``Llama`` runs one sequence);
  "absent" when llama-cpp-python is not installed. And a **torchao** row at each batch
  (:data:`TORCHAO`): int8 dynamic activations × int4 weights on torchao's CPU kernel
  (``da8w4``), through voxpipe's same runner: the standing "do we still need our own
  kernel?" comparison; where it cannot run here, the row says why.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

DEVICES = ("cpu", "cpu-int8", "cpu-int4", "cpu-int4+head", "cpu-int4-head", "cpu-int4-aten")
"""Rows: bf16, the two ``--device`` quantizations (LM head quantized when it is untied), int4
with the LM head forced quantized (``+head``) or bf16 (``-head``), and int4 on PyTorch's
kernel instead of voxpipe's (``-aten``)."""

TORCHAO = "torchao da8w4"
"""The torchao row: every linear layer (the LM head too unless tied to the input embedding, as
``cpu-int4`` does) quantized with torchao's ``Int8DynamicActivationInt4WeightConfig`` (group 32,
asymmetric uint8 activations per token), which runs the op ``torchao::da8w4_linear_cpu``."""
TORCHAO_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError, AssertionError)
"""What torchao's quantization or a decode through its tensors may raise (torchao checks with
``assert``): the row then says so instead of ending the bench."""


def torchao_missing() -> str | None:
    """Why the torchao row cannot run here, in one line; None when it can.

    torchao's CPU kernels are built only into its CPU wheels (``USE_CPU_KERNELS=1``); the
    PyPI wheel is a CUDA build whose extensions do not load beside a CPU torch, so with it
    the op exists but has no CPU kernel.
    """
    try:
        import torch
        import torchao
        from torchao.prototype.quantization.int4 import Int8DynamicActivationInt4WeightConfig  # noqa: F401
    except ImportError as exc:
        return f"absent: pip install -e '.[torchao]' ({exc})"
    try:
        kernels = torch._C._dispatch_dump("torchao::da8w4_linear_cpu")
    except RuntimeError:
        kernels = ""
    if "CPU" not in kernels:
        return (f"torchao {torchao.__version__} has no CPU kernel for torchao::da8w4_linear_cpu "
                "(a CUDA build, as on PyPI; its CPU build is on PyTorch's own index)")
    return None


def _load_torchao(name: str):
    """The bf16 model ``name`` with its linear layers on torchao's da8w4 CPU kernel
    (:data:`TORCHAO`); no oneDNN packing, which would replace the quantized layers."""
    import torch
    from torchao.prototype.quantization.int4 import Int8DynamicActivationInt4WeightConfig
    from torchao.quantization import quantize_
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.llm.loader import LoadedLLM, llm_folder

    folder = llm_folder(name)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and emb is not None and head.weight is emb.weight
    quantize_(model, Int8DynamicActivationInt4WeightConfig(group_size=32, set_inductor_config=False),
              filter_fn=lambda m, _fqn: isinstance(m, torch.nn.Linear) and not (tied and m is head))
    return LoadedLLM(model=model, tokenizer=AutoTokenizer.from_pretrained(str(folder)), name=name,
                     device=torch.device("cpu"), dtype=torch.bfloat16)


def _load(name: str, dev: str, threads: int | None = None):
    from pipeline.llm.loader import load_llm

    if dev == "cpu-int4-aten":
        return load_llm(name, device="cpu-int4", threads=threads, native_int4=False)
    head = {"+head": True, "-head": False}.get(dev[-5:])
    return load_llm(name, device=dev[:-5] if head is not None else dev, threads=threads, quant_head=head)


def add_arguments(p) -> None:
    """The options of ``voxpipe bench quant``."""
    p.add_argument("--llm", default="qwen")
    p.add_argument("--what", choices=["quality", "speed", "all"], default="all")
    p.add_argument("--devices", nargs="+", default=list(DEVICES[:3]), choices=DEVICES,
                   help="bf16 'cpu' is the reference (default: cpu cpu-int8 cpu-int4)")
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="torch (and llama.cpp) threads; a row each")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8], help="requests decoding together")
    p.add_argument("--prompts", type=int, default=0, help="use the first N prompts (0: all)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens compared per prompt")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per request in the speed table")
    p.add_argument("--repeats", type=int, default=3, help="speed runs per row, taken in turns (median)")
    p.add_argument("--compare-llamacpp", default="auto", metavar="GGUF",
                   help="GGUF for the llama.cpp row (auto: the --llm model's own; none: no row)")
    p.add_argument("--compare-torchao", choices=["auto", "none"], default="auto",
                   help="torchao's int8 x int4 CPU kernel (da8w4) at each batch (auto: a row each, or the "
                        "reason it cannot run here; none: no row)")
    p.add_argument("--json", action="store_true")


# ---- quality ---------------------------------------------------------------------------

@dataclass
class QualityRow:
    device: str
    prompts: int
    identical: float  # share of prompts whose first `tokens` greedy tokens equal bf16's
    mean_prefix: float  # mean matching prefix length (tokens)
    ppl: float  # perplexity of the bf16 continuations under this model
    ppl_ratio: float


def chat_ids(tokenizer, text: str) -> list[int]:
    """The prompt ids the engine would build for one user turn (its chat template)."""
    enc = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(enc["input_ids"] if isinstance(enc, dict) or hasattr(enc, "keys") else enc)


def greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` (no EOS stop: the comparison is over fixed lengths),
    the prompt's prefill too through the quantized kernels (:func:`forced_quantized`): the
    path voxpipe's int4 kernel serves on every CPU without AMX, measured the same way on any."""
    import torch

    with torch.inference_mode(), forced_quantized(model):
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


@contextmanager
def forced_quantized(model):
    """Within: every :class:`QuantLinear` of ``model`` runs its quantized kernel whatever the
    rows (a teacher-forced forward is one wide step, which would otherwise take the bf16 copy)."""
    from pipeline.llm.runner.quant_linear import QuantLinear

    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    saved = [m.max_rows for m in layers]
    for m in layers:
        m.max_rows = None
    try:
        yield
    finally:
        for m, r in zip(layers, saved, strict=True):
            m.max_rows = r


def nll(model, ids: list[int], cont: list[int]) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, token count) of ``cont`` after ``ids``."""
    import torch

    with torch.inference_mode(), forced_quantized(model):
        logits = model(torch.tensor([ids + cont])).logits[0, len(ids) - 1:-1].float()
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(cont), reduction="sum")), len(cont)


def prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def quality(name: str, devices: list[str], prompts: list[str], tokens: int, threads: int) -> list[QualityRow]:
    """The quality table: bf16 (``cpu``) first, then each other device against it."""
    ref = _load(name, "cpu", threads)
    ids = [chat_ids(ref.tokenizer, p) for p in prompts]
    conts = [greedy(ref.model, i, tokens) for i in ids]
    rows: list[QualityRow] = []
    for dev in ["cpu", *[d for d in devices if d != "cpu"]]:
        llm = ref if dev == "cpu" else _load(name, dev, threads)
        outs = conts if dev == "cpu" else [greedy(llm.model, i, tokens) for i in ids]
        pref = [prefix_len(o, c) for o, c in zip(outs, conts, strict=True)]
        lls = [nll(llm.model, i, c) for i, c in zip(ids, conts, strict=True)]
        ppl = math.exp(sum(x for x, _ in lls) / sum(n for _, n in lls))
        rows.append(QualityRow(dev, len(prompts), round(sum(p == tokens for p in pref) / len(pref), 3),
                               round(statistics.mean(pref), 2), round(ppl, 4),
                               round(ppl / rows[0].ppl, 4) if rows else 1.0))
        if dev != "cpu":
            del llm
    return rows


# ---- speed -----------------------------------------------------------------------------

@dataclass
class SpeedRow:
    engine: str
    threads: int
    batch: int
    tok_s: float | None  # aggregate decode tokens/s (None: absent)
    ms_per_step: float | None
    note: str = ""


def runner_decode(llm, prompts: list[list[int]], batch: int, n: int) -> tuple[float, float]:
    """(aggregate decode tok/s, median ms per pure decode step) of ``batch`` requests decoding
    ``n`` tokens together in voxpipe's runner (prefill steps not timed)."""
    from pipeline.config import SchedulerConfig
    from pipeline.llm.runner.runner import ModelRunner
    from pipeline.llm.scheduler import Scheduler
    from pipeline.llm.types import SchedRequest

    runner = ModelRunner(llm.model, llm.device, pad_id=0, prefix_cache=False)
    sched = Scheduler(SchedulerConfig(max_batch_size=batch, max_wait_ms=0))
    for rid in range(batch):
        sched.add(SchedRequest(rid=rid, prompt_ids=prompts[rid % len(prompts)], max_new_tokens=n, arrival=0))
    steps: list[tuple[int, float]] = []
    while sched.has_work():
        plan = sched.schedule(now=1e9)
        t0 = time.perf_counter()
        out = runner.execute(plan)
        dt = time.perf_counter() - t0
        if plan.decode and not plan.spans:
            steps.append((len(plan.decode), dt))
        sched.update(plan, out)
    full = [(k, dt) for k, dt in steps if k == batch] or steps  # the steady part: every row decoding
    return sum(k for k, _ in full) / sum(dt for _, dt in full), statistics.median(dt for _, dt in full) * 1000


def llamacpp_decode(gguf: str, prompt: str, threads: int, n: int) -> tuple[float, float]:
    """(decode tok/s, ms per token) of llama.cpp on ``gguf``: greedy, batch 1, after the prompt.

    Raises:
        ImportError: llama-cpp-python is not installed.
    """
    from llama_cpp import Llama

    m = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
    gen = m.generate(m.tokenize(prompt.encode()), top_k=1, temp=0.0, reset=True)
    next(gen)  # prompt evaluation and the first token
    t0 = time.perf_counter()
    for _ in range(n - 1):
        next(gen)
    dt = (time.perf_counter() - t0) / (n - 1)
    return 1 / dt, dt * 1000


def speed(name: str, devices: list[str], threads: list[int], batches: list[int], prompts: list[str], n: int,
          gguf: str | None, repeats: int = 3, torchao: bool = False) -> list[SpeedRow]:
    """The speed table: one row per engine × threads × batch, the median of ``repeats`` runs
    taken in turns across the engines (all loaded at once), so that load on a shared machine
    falls on every row alike. ``torchao``: the :data:`TORCHAO` rows too (each saying why where
    it cannot run)."""
    import torch

    llms = {f"voxpipe {dev}": _load(name, dev) for dev in devices}
    failed: dict[str, str] = {}  # engine -> why it has no figures
    if torchao:
        failed[TORCHAO] = torchao_missing() or ""
        if not failed[TORCHAO]:
            try:
                llms[TORCHAO] = _load_torchao(name)
                del failed[TORCHAO]
            except TORCHAO_ERRORS as exc:
                failed[TORCHAO] = f"quantization failed: {exc}".splitlines()[0]
    ids = [chat_ids(next(iter(llms.values())).tokenizer, p) for p in prompts]
    rows: list[SpeedRow] = []
    for t in threads:
        torch.set_num_threads(t)
        for engine, llm in llms.items():
            if engine != TORCHAO:
                runner_decode(llm, ids, 1, 4)  # warm-up
        if TORCHAO in llms:  # warm-up, and a check of torchao's layers at every batch measured
            try:
                for b in (1, *batches):
                    runner_decode(llms[TORCHAO], ids, b, 4 if b == 1 else 2)
            except TORCHAO_ERRORS as exc:
                failed[TORCHAO] = f"decode failed: {exc}".splitlines()[0]
                del llms[TORCHAO]
        for b in batches:
            runs: dict[str, list[tuple[float, float]]] = {engine: [] for engine in llms}
            for _ in range(repeats):
                for engine, llm in llms.items():
                    runs[engine].append(runner_decode(llm, ids, b, n))
            rows += [SpeedRow(engine, t, b, round(statistics.median(r[0] for r in rs), 1),
                              round(statistics.median(r[1] for r in rs), 1)) for engine, rs in runs.items()]
            rows += [SpeedRow(engine, t, b, None, None, why) for engine, why in failed.items()]
    if gguf is not None:
        for t in threads:
            try:
                tok_s, ms = llamacpp_decode(gguf, prompts[0], t, n)
                rows.append(SpeedRow("llama.cpp", t, 1, round(tok_s, 1), round(ms, 1), "batch 1 only"))
            except ImportError:
                rows.append(SpeedRow("llama.cpp", t, 1, None, None, "absent: pip install -e '.[llamacpp]'"))
    return rows


# ---- the command -----------------------------------------------------------------------

def _gguf(args) -> str | None:
    if args.compare_llamacpp == "none":
        return None
    if args.compare_llamacpp != "auto":
        return str(args.compare_llamacpp)
    from pipeline import model_files

    return str({"qwen": model_files.qwen_gguf, "qwen1.5b": model_files.qwen15_gguf,
                "smollm2": model_files.smollm2_gguf}[args.llm]())


def main(args) -> int:
    """``voxpipe bench quant``: print the quality and/or speed tables (JSON with ``--json``)."""
    from bench.prompts import load_prompts

    prompts = [p.text for p in load_prompts()]
    prompts = prompts[:args.prompts] if args.prompts else prompts
    out: dict[str, list] = {}
    if args.what in ("quality", "all"):
        out["quality"] = quality(args.llm, args.devices, prompts, args.tokens, args.threads[0])
    if args.what in ("speed", "all"):
        out["speed"] = speed(args.llm, args.devices, args.threads, args.batches, prompts, args.decode_tokens,
                             _gguf(args), args.repeats, torchao=args.compare_torchao == "auto")
    if args.json:
        print(json.dumps({k: [asdict(r) for r in v] for k, v in out.items()}, indent=1))
    else:
        print(format_tables(args.llm, out))
    return 0


def format_tables(name: str, out: dict[str, list]) -> str:
    """Markdown tables of :func:`main`'s results."""
    lines: list[str] = []
    for key, rows in out.items():
        if not rows:
            continue
        head = list(asdict(rows[0]))
        lines += [f"LLM={name} {key}", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join("absent" if v is None else str(v) for v in asdict(r).values()) + " |"
                  for r in rows]
        lines.append("")
    return "\n".join(lines)
