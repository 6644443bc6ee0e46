"""Tool-calling benchmark (issue 32): does the model call the right tool with the right
arguments, call nothing on chit-chat, and what do the offered tools cost the first token?

Per model, every request of :mod:`bench.tool_set` is asked as a voice turn's first request
(the server's system prompt and example exchanges, :meth:`ChatHistory.prompt` within
``max_context_tokens - max_new_tokens`` counted with the tools, as
:class:`~pipeline.session.responder.Responder` builds it), greedy, through the real
:class:`~pipeline.llm.engine.LlmEngine` one request at a time, with the five tools of
:func:`bench.tool_set.tool_specs` offered (``tool_choice`` auto). The reply is read with
:class:`~pipeline.tools.reply.ToolReplyReader`. Each case's verdict (one per case):

- a tool case: ``right`` (the expected tool, arguments :func:`~bench.tool_set.args_ok`),
  ``wrong args``, ``wrong tool``, ``malformed`` (only botched call blocks: reader errors) or
  ``missed`` (no call block at all);
- a chit-chat case: ``quiet`` (no call block) or ``false call`` (a good or a botched one).

The same request without tools (1 new token) runs just before each: the time to first token
(ms, submit → first token, ``GenStats.ttft_ms``) and the prompt tokens with and without the
tools' section. Warm: the medians over the run (the prefix cache holds the system prompt, the
tools and the examples after the first request). Cold: the median of ``--cold`` first
requests, each after the engine's prefix cache was emptied (engine stopped, cache cleared,
started again).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field

from bench.tool_set import Case, args_ok, load_cases, tool_specs
from pipeline.config import LlmConfig
from pipeline.llm.types import GenRequest, GenStats
from pipeline.tools.reply import ToolReplyReader
from pipeline.tools.types import ToolSpec

TOOL_VERDICTS = ("right", "wrong args", "wrong tool", "malformed", "missed")
"""A tool case's verdicts; exactly one per case."""
NONE_VERDICTS = ("quiet", "false call")
"""A chit-chat case's verdicts; exactly one per case."""
FRAMINGS = {"server": "the server's system prompt and its example exchanges (LlmConfig.examples)",
            "no-examples": "the server's system prompt alone (voxpipe serve --llm-examples '[]')"}
"""``--framing``: what comes before the request."""


@dataclass(slots=True)
class Outcome:
    """One case's result.

    Attributes:
        text: the request. kind: the case's kind (``time`` ... ``none``).
        expected: the tool a right reply calls (None: nothing).
        called: the first good call's tool (None: no good call). arguments: its arguments.
        verdict: one of :data:`TOOL_VERDICTS` or :data:`NONE_VERDICTS`.
        errors: the reader's errors (botched calls), as ``reason: message``.
        reply: the reply's text outside call blocks.
        ttft_ms, ttft_plain_ms: time to first token with and without tools (ms).
        prompt_tokens, prompt_tokens_plain: the prompt's tokens with and without tools.
    """

    text: str
    kind: str
    expected: str | None
    called: str | None
    arguments: dict | None
    verdict: str
    errors: list[str]
    reply: str
    ttft_ms: float
    ttft_plain_ms: float
    prompt_tokens: int
    prompt_tokens_plain: int


@dataclass(slots=True)
class Row:
    """One model's line of the table (counts of cases; rates over every case; ms)."""

    model: str
    framing: str
    cases: int
    tool_cases: int
    none_cases: int
    right: int
    wrong_args: int
    wrong_tool: int
    malformed_tool: int
    missed: int
    quiet: int
    false_calls: int
    malformed: int
    tool_rate: float
    tool_args_rate: float
    ttft_p50_plain_ms: float
    ttft_p50_tools_ms: float
    ttft_cold_plain_ms: float
    ttft_cold_tools_ms: float
    prompt_tokens_plain: int
    prompt_tokens_tools: int
    by_kind: dict[str, str] = field(default_factory=dict)
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def tool_ok(self) -> int:
        """Cases with the right tool (or none on chit-chat), whatever the arguments."""
        return self.right + self.wrong_args + self.quiet

    @property
    def tool_args_ok(self) -> int:
        """Cases with the right tool and arguments (or none on chit-chat)."""
        return self.right + self.quiet


def messages_for(engine, text: str, specs: tuple[ToolSpec, ...], cfg: LlmConfig) -> list[dict]:
    """A voice turn's first request for ``text``: the server's system prompt and examples,
    with the first offered tool's worked example after them, within the context budget
    counted with ``specs`` offered — as :class:`~pipeline.session.responder.Responder` builds it."""
    from pipeline.session.history import ChatHistory
    from pipeline.tools.render import demo_exchange

    history = ChatHistory(cfg.system_prompt, examples=cfg.examples)
    demo = demo_exchange(specs)
    return history.prompt(text, lambda msgs: engine.count_tokens(msgs, specs),
                          cfg.max_context_tokens - cfg.max_new_tokens, demos=(demo,) if demo is not None else ())


async def ask(engine, text: str, specs: tuple[ToolSpec, ...], cfg: LlmConfig,
              max_new_tokens: int) -> tuple[str, GenStats]:
    """The greedy reply to ``text`` (``specs`` offered, or none) and its stream's stats."""
    msgs = await asyncio.to_thread(messages_for, engine, text, specs, cfg)
    stream = engine.submit(GenRequest(messages=msgs, max_new_tokens=max_new_tokens, tools=specs))
    reply = "".join([d async for d in stream])
    return reply, stream.stats


def judge(case: Case, reply: str, specs: tuple[ToolSpec, ...]) -> tuple[str, ToolReplyReader]:
    """``case``'s verdict on ``reply`` (see the module docstring) and the reader that read it."""
    reader = ToolReplyReader(specs)
    reader.feed(reply)
    reader.finish()
    call = reader.calls[0] if reader.calls else None
    if case.tool is None:
        return ("false call" if reader.calls or reader.errors else "quiet"), reader
    if call is None:
        return ("malformed" if reader.errors else "missed"), reader
    if call.name != case.tool:
        return "wrong tool", reader
    return ("right" if args_ok(case, call.arguments) else "wrong args"), reader


def run_case(engine, case: Case, specs: tuple[ToolSpec, ...], cfg: LlmConfig) -> Outcome:
    """Ask ``case`` without tools (1 token: its TTFT), then with them (the whole reply)."""
    _, plain = asyncio.run(ask(engine, case.text, (), cfg, 1))
    reply, st = asyncio.run(ask(engine, case.text, specs, cfg, cfg.max_new_tokens))
    verdict, reader = judge(case, reply, specs)
    call = reader.calls[0] if reader.calls else None
    return Outcome(text=case.text, kind=case.kind, expected=case.tool, called=call.name if call else None,
                   arguments=call.arguments if call else None, verdict=verdict,
                   errors=[f"{e.reason}: {e.message}" for e in reader.errors], reply=reader.text.strip(),
                   ttft_ms=round(st.ttft_ms, 1), ttft_plain_ms=round(plain.ttft_ms, 1),
                   prompt_tokens=st.prompt_tokens, prompt_tokens_plain=plain.prompt_tokens)


def cold_ttft(engine, cases: list[Case], specs: tuple[ToolSpec, ...], cfg: LlmConfig) -> float:
    """Median TTFT (ms) of each case's first token asked on an empty prefix cache."""
    out = []
    for case in cases:
        engine.stop()  # the engine thread is gone: its cache can be emptied safely
        engine.prefix.clear()
        engine.start()
        out.append(asyncio.run(ask(engine, case.text, specs, cfg, 1))[1].ttft_ms)
    return round(statistics.median(out), 1) if out else 0.0


def summarize(model: str, framing: str, outcomes: list[Outcome], cold: tuple[float, float]) -> Row:
    """The table row of one model's outcomes and its cold TTFTs (without, with tools; ms)."""
    n = Counter(o.verdict if o.expected else f"none {o.verdict}" for o in outcomes)
    tool_cases = sum(o.expected is not None for o in outcomes)
    none_cases = len(outcomes) - tool_cases
    kinds = list(dict.fromkeys(o.kind for o in outcomes))
    by_kind = {k: f"{sum(o.verdict in ('right', 'quiet') for o in outcomes if o.kind == k)}/"
                  f"{sum(o.kind == k for o in outcomes)}" for k in kinds}

    def p50(xs: list[float]) -> float:
        return round(statistics.median(xs), 1) if xs else 0.0

    row = Row(model=model, framing=framing, cases=len(outcomes), tool_cases=tool_cases, none_cases=none_cases,
              right=n["right"],
              wrong_args=n["wrong args"], wrong_tool=n["wrong tool"], malformed_tool=n["malformed"],
              missed=n["missed"], quiet=n["none quiet"], false_calls=n["none false call"],
              malformed=sum(bool(o.errors) for o in outcomes), tool_rate=0.0, tool_args_rate=0.0,
              ttft_p50_plain_ms=p50([o.ttft_plain_ms for o in outcomes]),
              ttft_p50_tools_ms=p50([o.ttft_ms for o in outcomes]),
              ttft_cold_plain_ms=cold[0], ttft_cold_tools_ms=cold[1],
              prompt_tokens_plain=round(p50([o.prompt_tokens_plain for o in outcomes])),
              prompt_tokens_tools=round(p50([o.prompt_tokens for o in outcomes])), by_kind=by_kind,
              outcomes=outcomes)
    if outcomes:
        row.tool_rate = round(row.tool_ok / len(outcomes), 3)
        row.tool_args_rate = round(row.tool_args_ok / len(outcomes), 3)
    return row


def run_model(model: str, cases: list[Case], args) -> Row:
    """Load ``model`` (``qwen``, ``smollm2`` or a local folder) as ``voxpipe serve`` does and
    run every case; then the cold first requests."""
    from pipeline.config import VoxpipeConfig
    from pipeline.cpu_share import in_own_thread_sync
    from pipeline.engines import load_stage

    framing = getattr(args, "framing", "server")
    examples = LlmConfig().examples if framing == "server" else ()
    cfg = VoxpipeConfig(llm=LlmConfig(model=model, device=args.device, threads=args.threads, examples=examples))
    # in a thread that ends: a live thread's OpenMP team would throttle the engine's (bench/llm.py)
    engine = in_own_thread_sync(load_stage, cfg, "llm")
    specs = tool_specs()
    engine.start()
    try:
        asyncio.run(ask(engine, "Hi", (), cfg.llm, 4))  # warm-up: kernels, not the prompts' prefix
        cold = (cold_ttft(engine, cases[:args.cold], (), cfg.llm), cold_ttft(engine, cases[:args.cold], specs, cfg.llm))
        outcomes = [run_case(engine, c, specs, cfg.llm) for c in cases]
    finally:
        engine.stop()
    return summarize(os.path.basename(model.rstrip("/")) or model, framing, outcomes, cold)


def format_table(rows: list[Row]) -> str:
    """The Markdown table (rates over every case; ms), then each model's right calls per kind."""
    head = ["model", "framing", "cases", "right tool", "right tool + args", "false calls (chit-chat)", "missed",
            "wrong tool", "wrong args", "malformed", "prompt tok no tools / tools", "TTFT p50 no tools / tools",
            "cold TTFT no tools / tools"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(v) for v in (
            r.model, r.framing, r.cases, f"{r.tool_ok}/{r.cases} {r.tool_rate:.0%}",
            f"{r.tool_args_ok}/{r.cases} {r.tool_args_rate:.0%}", f"{r.false_calls}/{r.none_cases}",
            f"{r.missed}/{r.tool_cases}", r.wrong_tool, r.wrong_args, r.malformed,
            f"{r.prompt_tokens_plain} / {r.prompt_tokens_tools}",
            f"{r.ttft_p50_plain_ms:.0f} / {r.ttft_p50_tools_ms:.0f}",
            f"{r.ttft_cold_plain_ms:.0f} / {r.ttft_cold_tools_ms:.0f}")) + " |")
    for r in rows:
        lines.append(f"{r.model} ({r.framing}), right tool + args per kind: "
                     + ", ".join(f"{k} {v}" for k, v in r.by_kind.items()))
    return "\n".join(lines)


def format_misses(rows: list[Row], show: int) -> str:
    """Up to ``show`` cases per model that were not right, with what the model wrote."""
    lines = []
    for r in rows:
        for o in [o for o in r.outcomes if o.verdict not in ("right", "quiet")][:show]:
            what = f"{o.called}({json.dumps(o.arguments, ensure_ascii=False)})" if o.called else \
                (o.errors[0] if o.errors else repr(o.reply[:80]))
            lines.append(f"  [{r.model} {r.framing}] {o.verdict}: {o.text!r} -> {what}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    """``voxpipe bench tools`` options."""
    p.add_argument("--llm", nargs="+", default=["qwen", "smollm2"],
                   help="models: qwen1.5b, qwen, smollm2 or a local model folder (default: qwen smollm2)")
    p.add_argument("--device", default=LlmConfig().device,
                   help="auto (the serving default), cpu (bf16), cpu-int4, cpu-fp32, cuda, ...")
    p.add_argument("--threads", type=int, default=LlmConfig().threads)
    p.add_argument("--framing", default="server", choices=list(FRAMINGS),
                   help="; ".join(f"{k}: {v}" for k, v in FRAMINGS.items()).replace("%", "%%"))
    p.add_argument("--cases", type=int, default=None,
                   help="run this many cases, picked across kinds, chit-chat first (default: all 48)")
    p.add_argument("--cold", type=int, default=3,
                   help="first requests on an empty prefix cache per model, with and without tools (3)")
    p.add_argument("--show", type=int, default=8, help="cases that were not right printed per model (8)")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows with every case)")


def main(args) -> int:
    """``voxpipe bench tools``: print the table (or JSON with ``--json``)."""
    cases = load_cases(args.cases)
    models = [m for arg in args.llm for m in arg.split(",") if m]
    rows = [run_model(model, cases, args) for model in models]
    if args.json:
        print(json.dumps({"rows": [asdict(r) | {"tool_ok": r.tool_ok, "tool_args_ok": r.tool_args_ok}
                                   for r in rows]}, ensure_ascii=False))
    else:
        print(format_table(rows))
        misses = format_misses(rows, args.show)
        if misses:
            print(misses)
    return 0
