"""Reply benchmark: does the assistant answer, or parrot? (issue 16, item 3).

For each model and each chat framing (a system prompt, with or without example exchanges), the
greedy replies to every prompt of ``bench/prompts.tsv`` through the real :class:`LlmEngine`,
with the messages the session builds (:meth:`ChatHistory.prompt`, the context budget and
``max_new_tokens`` of :class:`LlmConfig`). Per row: the parrot rate (:mod:`bench.parrot`), in
total and per prompt kind; mean reply words; empty replies; the first-turn prompt tokens the
framing costs (prefilled once per session, then found in the prefix cache); throughput while
the set runs at ``--concurrency``; and per model, batch-1 decode speed (1000 / the median
time per output token of 4 replies run alone) and their median time to first token.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from bench.parrot import overlap, parrots, words
from bench.prompts import KINDS, Prompt, load_prompts
from pipeline.config import LlmConfig
from pipeline.llm.types import GenRequest, GenStats

PARTNER_PROMPT = ("You are a friendly voice assistant in a spoken conversation. Respond as a conversation "
                  "partner: answer questions directly; when the person tells you something, react to it with "
                  "a short comment or ask a question back. Never repeat or quote what they said. "
                  "Use one or two short sentences.")
"""A longer system prompt that asks not to repeat (measured: helps little without examples)."""


@dataclass(frozen=True, slots=True)
class Framing:
    """How a turn is framed: ``system`` prompt (None: no system message, the chat template's
    own default) and the ``examples`` exchanges after it (``LlmConfig.examples``)."""

    system: str | None
    examples: tuple[tuple[str, str], ...] = ()


def framings() -> dict[str, Framing]:
    """The framings compared, by name; ``server`` is what ``voxpipe serve`` sends by default."""
    cfg = LlmConfig()
    return {
        "server": Framing(cfg.system_prompt, cfg.examples),
        "before": Framing(cfg.system_prompt),  # the framing before issue 16: the same prompt, no examples
        "partner": Framing(PARTNER_PROMPT),
        "partner+examples": Framing(PARTNER_PROMPT, cfg.examples),
        "template-default": Framing(None),
    }


@dataclass(slots=True)
class Reply:
    """One prompt's reply: ``text``, its word ``overlap`` with the prompt, whether it ``parrots``."""

    kind: str
    prompt: str
    text: str
    overlap: float
    parrots: bool
    output_tokens: int


@dataclass(slots=True)
class Row:
    model: str
    framing: str
    prompts: int
    parrot_rate: float
    parrots: int
    parrots_by_kind: dict[str, str]
    mean_words: float
    empty: int
    first_turn_prompt_tokens: int
    tok_s_concurrent: float
    decode_tok_s_b1: float = 0.0
    ttft_ms_b1: float = 0.0
    replies: list[Reply] = field(default_factory=list)


def messages_for(engine, framing: Framing, text: str, turns: Sequence[tuple[str, str]] = ()) -> list[dict]:
    """The chat messages for ``text`` as the session builds them (within the context budget of
    :class:`LlmConfig`, counted with ``engine``'s tokenizer): the first turn, or the turn after
    the earlier (user, assistant) exchanges ``turns``."""
    from pipeline.session.history import ChatHistory

    cfg = LlmConfig()
    history = ChatHistory(framing.system or "", examples=framing.examples)
    for user, assistant in turns:
        history.add_turn(user, assistant)
    msgs = history.prompt(text, engine.count_tokens, cfg.max_context_tokens - cfg.max_new_tokens)
    return msgs if framing.system is not None else msgs[1:]


async def generate(engine, framing: Framing, prompts: list[Prompt], *, concurrency: int = 8,
                   max_new_tokens: int = LlmConfig().max_new_tokens) -> list[tuple[Reply, GenStats]]:
    """Greedy replies to ``prompts`` (in order) at most ``concurrency`` at a time through a
    started :class:`~pipeline.llm.engine.LlmEngine`; each with its stream's ``GenStats``."""
    gate = asyncio.Semaphore(concurrency)

    async def one(p: Prompt) -> tuple[Reply, GenStats]:
        async with gate:
            msgs = await asyncio.to_thread(messages_for, engine, framing, p.text)
            stream = engine.submit(GenRequest(messages=msgs, max_new_tokens=max_new_tokens))
            text = "".join([d async for d in stream])
        return Reply(p.kind, p.text, text, round(overlap(p.text, text), 3), parrots(p.text, text),
                     stream.stats.output_tokens), stream.stats

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def summarize(model: str, name: str, engine, framing: Framing, replies: list[Reply], wall_s: float) -> Row:
    """One table row from a framing's replies."""
    n = len(replies)
    by_kind: dict[str, str] = {
        k: f"{sum(r.parrots for r in replies if r.kind == k)}/{sum(r.kind == k for r in replies)}"
        for k in KINDS if any(r.kind == k for r in replies)}
    hits = sum(r.parrots for r in replies)
    return Row(model=model, framing=name, prompts=n, parrot_rate=round(hits / n, 3) if n else 0.0, parrots=hits,
               parrots_by_kind=by_kind,
               mean_words=round(statistics.mean(len(words(r.text)) for r in replies), 1) if n else 0.0,
               empty=sum(not words(r.text) for r in replies),
               first_turn_prompt_tokens=engine.count_tokens(messages_for(engine, framing, "")),
               tok_s_concurrent=round(sum(r.output_tokens for r in replies) / wall_s, 1) if wall_s else 0.0,
               replies=replies)


def batch1_speed(engine, framing: Framing, prompts: list[Prompt], max_new_tokens: int) -> tuple[float, float]:
    """(decode tok/s, TTFT ms) at batch 1: medians over ``prompts`` run one at a time."""
    tpot, ttft = [], []
    for p in prompts:
        _, st = asyncio.run(generate(engine, framing, [p], concurrency=1, max_new_tokens=max_new_tokens))[0]
        if st.tpot_ms:
            tpot.append(st.tpot_ms)
        ttft.append(st.ttft_ms)
    return (round(1000 / statistics.median(tpot), 1) if tpot else 0.0,
            round(statistics.median(ttft), 1) if ttft else 0.0)


def run_model(model: str, names: list[str], prompts: list[Prompt], args) -> list[Row]:
    """Load ``model`` once and run every framing in ``names`` on ``prompts``."""
    from pipeline.config import SchedulerConfig
    from pipeline.llm.engine import LlmEngine
    from pipeline.llm.loader import load_llm

    llm = load_llm(model, device=args.device, threads=args.threads)
    engine = LlmEngine(llm, LlmConfig(queue_size=max(64, len(prompts))),
                       SchedulerConfig(max_batch_size=max(1, args.concurrency)))
    table = framings()
    rows: list[Row] = []
    engine.start()
    try:
        asyncio.run(generate(engine, table["server"], [Prompt("question", "Hi")], max_new_tokens=4))  # warm-up
        speed = batch1_speed(engine, table["server"], [p for p in prompts if p.kind == "question"][:4],
                             args.max_new_tokens)
        for name in names:
            t0 = time.perf_counter()
            out = asyncio.run(generate(engine, table[name], prompts, concurrency=args.concurrency,
                                       max_new_tokens=args.max_new_tokens))
            row = summarize(model, name, engine, table[name], [r for r, _ in out], time.perf_counter() - t0)
            row.decode_tok_s_b1, row.ttft_ms_b1 = speed
            rows.append(row)
    finally:
        engine.stop()
    return rows


def _print(rows: list[Row], show: int) -> None:
    head = (f"{'model':<10} {'framing':<17} {'parrot':>12} {'stmt':>6} {'quest':>6} {'clip':>5} {'words':>6} "
            f"{'empty':>5} {'prompt tok':>10} {'tok/s c':>8} {'tok/s b1':>8} {'ttft b1':>8}")
    print(head)
    print("-" * len(head))
    for r in rows:
        k = r.parrots_by_kind
        print(f"{r.model:<10} {r.framing:<17} {f'{r.parrots}/{r.prompts} {r.parrot_rate:.0%}':>12} "
              f"{k.get('statement', '-'):>6} {k.get('question', '-'):>6} {k.get('clip', '-'):>5} "
              f"{r.mean_words:>6} {r.empty:>5} {r.first_turn_prompt_tokens:>10} {r.tok_s_concurrent:>8} "
              f"{r.decode_tok_s_b1:>8} {r.ttft_ms_b1:>8}")
    for r in rows:
        shown = [x for x in r.replies if x.parrots][:show] or r.replies[:min(show, 1)]
        for x in shown:
            print(f"  [{r.model} {r.framing}] {'PARROT ' if x.parrots else ''}{x.prompt!r} -> {x.text[:100]!r}")


def add_arguments(p) -> None:
    """``voxpipe bench replies`` options."""
    p.add_argument("--llm", default="qwen,smollm2", help="models, comma-separated (qwen,smollm2)")
    p.add_argument("--framing", default=None,
                   help=f"framings, comma-separated (default all: {', '.join(framings())})")
    p.add_argument("--device", default=LlmConfig().device,
                   help="auto (the serving default), cpu (bf16), cpu-int4, cpu-fp32, cuda, ...")
    p.add_argument("--threads", type=int, default=LlmConfig().threads)
    p.add_argument("--concurrency", type=int, default=8, help="replies generated together (8)")
    p.add_argument("--max-new-tokens", type=int, default=LlmConfig().max_new_tokens)
    p.add_argument("--kinds", default=",".join(KINDS), help="prompt kinds to run (statement,question,clip)")
    p.add_argument("--show", type=int, default=3, help="parroting replies printed per row (3)")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows with every reply)")


def main(args) -> int:
    """``voxpipe bench replies``: print the table (or JSON with ``--json``); 2 on a bad option."""
    import sys

    table = framings()
    names = args.framing.split(",") if args.framing else list(table)
    kinds = tuple(args.kinds.split(","))
    bad = [n for n in names if n not in table] + [k for k in kinds if k not in KINDS]
    if bad:
        print(f"voxpipe bench replies: unknown framing or kind {', '.join(bad)}", file=sys.stderr)
        return 2
    prompts = load_prompts(kinds=kinds)
    rows = [row for model in args.llm.split(",") for row in run_model(model, names, prompts, args)]
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows]}, ensure_ascii=False))
    else:
        _print(rows, args.show)
    return 0
