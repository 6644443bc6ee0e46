"""Reply quality benchmark: are the replies right, short, spoken and on point? (issue 33, item 1).

For each model and chat framing (:func:`bench.replies.framings`), the greedy replies to every
item of ``bench/quality_set.tsv`` (:mod:`bench.quality_set`) through the real
:class:`~pipeline.llm.engine.LlmEngine`, with the messages the session builds (a followup's
earlier exchanges in its history). Then an LLM judge (``--judge``, loaded once after the
models) scores the open items 1-5 by a fixed rubric (:mod:`bench.quality_score`), greedy.

Per row: fact accuracy (``fact`` and ``followup`` items with key facts: any pattern occurs),
the rule pass rate (``request`` and ``talk``), the parrot rate (all items; an answer that restates
the question with its key fact is not a parrot), the empty and
truncated rates (all items), mean reply words, and the judge's mean score over the open items
(``request``, ``talk``, ``clip`` and ``followup`` without a fact). The judge's agreement with
30 hand labels (``bench/quality_labels.tsv``) is printed with it, so that its score can be
trusted as far as it deserves; ``--agreement`` prints only that.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field

from bench.parrot import parrots, words
from bench.quality_score import (
    CLASS_RULES,
    JUDGE_MAX_NEW_TOKENS,
    Agreement,
    agreement,
    failed_rules,
    is_truncated,
    judge_messages,
    load_labels,
    parse_score,
)
from bench.quality_set import CLASSES, Item, fact_ok, load_items
from bench.replies import Framing, framings, messages_for
from pipeline.config import LlmConfig
from pipeline.llm.types import GenRequest

JUDGE_FALLBACK = ("qwen1.5b", "qwen")
"""Judges tried in order, largest first, when the asked one is not installed (from its place on)."""
JUDGED = ("request", "talk", "clip", "followup")
"""Classes the judge scores (a followup only without key facts)."""


@dataclass(slots=True)
class Result:
    """One item's reply and its scores: ``fact`` (None: not a fact item), ``failed`` rules
    (None: not rule-scored), ``judge`` (None: not judged, or the judge wrote no digit)."""

    cls: str
    text: str
    reply: str
    finish_reason: str
    output_tokens: int
    words: int
    parrots: bool
    empty: bool
    truncated: bool
    fact: bool | None = None
    failed: list[str] | None = None
    judge: int | None = None
    history: list[list[str]] = field(default_factory=list)

    @property
    def judged(self) -> bool:
        """Whether the judge scores this item."""
        return self.cls in JUDGED and self.fact is None


@dataclass(slots=True)
class Row:
    """One model × framing: counts ``(passed, of)`` and rates, and every :class:`Result`."""

    model: str
    framing: str
    n: int
    fact: tuple[int, int]
    rules: tuple[int, int]
    parrots: int
    empty: int
    truncated: int
    mean_words: float
    judge_mean: float | None
    judged: int
    unparsed: int
    results: list[Result] = field(default_factory=list)


def score(item: Item, reply: str, finish_reason: str, output_tokens: int) -> Result:
    """A reply's automatic scores (all but the judge's). A reply that restates the question and
    holds the key fact ("The capital of Spain is Madrid.") does not count as parroting."""
    fact = fact_ok(item.answers, reply) if item.has_fact else None
    res = Result(cls=item.cls, text=item.text, reply=reply, finish_reason=finish_reason, output_tokens=output_tokens,
                 words=len(words(reply)), parrots=parrots(item.text, reply) and not fact, empty=not words(reply),
                 truncated=bool(words(reply)) and is_truncated(reply, finish_reason),
                 history=[list(x) for x in item.history], fact=fact)
    if item.cls in CLASS_RULES:
        res.failed = failed_rules(item.cls, item.text, reply, finish_reason)
    return res


def summarize(model: str, framing: str, results: list[Result]) -> Row:
    """One table row from a framing's scored results."""
    facts = [r.fact for r in results if r.fact is not None]
    ruled = [r.failed for r in results if r.failed is not None]
    judged = [r for r in results if r.judged]
    scores = [r.judge for r in judged if r.judge is not None]
    return Row(model=model, framing=framing, n=len(results), fact=(sum(facts), len(facts)),
               rules=(sum(not f for f in ruled), len(ruled)), parrots=sum(r.parrots for r in results),
               empty=sum(r.empty for r in results), truncated=sum(r.truncated for r in results),
               mean_words=round(statistics.mean(r.words for r in results), 1) if results else 0.0,
               judge_mean=round(statistics.mean(scores), 2) if scores else None, judged=len(judged),
               unparsed=len(judged) - len(scores), results=results)


async def _replies(engine, framing: Framing, items: list[Item], concurrency: int,
                   max_new_tokens: int) -> list[Result]:
    gate = asyncio.Semaphore(concurrency)

    async def one(it: Item) -> Result:
        async with gate:
            msgs = await asyncio.to_thread(messages_for, engine, framing, it.text, it.history)
            stream = engine.submit(GenRequest(messages=msgs, max_new_tokens=max_new_tokens))
            text = "".join([d async for d in stream])
        return score(it, text, str(stream.stats.finish_reason), stream.stats.output_tokens)

    return list(await asyncio.gather(*(one(it) for it in items)))


async def judge_all(engine, items: list[tuple[str, str, list[list[str]]]], concurrency: int) -> list[int | None]:
    """The judge's scores of ``(user, reply, history)`` triples, in order (greedy; an empty reply
    is 1 by the rubric without asking; None where the judge wrote no digit 1-5)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(user: str, reply: str, history: list[list[str]]) -> int | None:
        if not words(reply):
            return 1
        async with gate:
            msgs = judge_messages(user, reply, [(u, a) for u, a in history])
            stream = engine.submit(GenRequest(messages=msgs, max_new_tokens=JUDGE_MAX_NEW_TOKENS))
            return parse_score("".join([d async for d in stream]))

    return list(await asyncio.gather(*(one(*x) for x in items)))


def _engine(name: str, args, queue: int):
    from pipeline.config import SchedulerConfig
    from pipeline.llm.engine import LlmEngine
    from pipeline.llm.loader import load_llm

    llm = load_llm(name, device=args.device, threads=args.threads)
    return LlmEngine(llm, LlmConfig(queue_size=max(64, queue)),
                     SchedulerConfig(max_batch_size=max(1, args.concurrency)))


def run_model(model: str, names: list[str], items: list[Item], args) -> list[tuple[str, list[Result]]]:
    """Load ``model`` once and reply to ``items`` under each framing of ``names``:
    ``[(framing, results)]`` scored but not yet judged."""
    engine = _engine(model, args, len(items))
    table = framings()
    engine.start()
    try:
        asyncio.run(_replies(engine, table["server"], [Item("talk", "Hi")], 1, 4))  # warm-up
        return [(name, asyncio.run(_replies(engine, table[name], items, args.concurrency, args.max_new_tokens)))
                for name in names]
    finally:
        engine.stop()


def judge_candidates(name: str) -> list[str]:
    """``name``, then (when it is in :data:`JUDGE_FALLBACK`) the smaller judges after it."""
    return [name, *JUDGE_FALLBACK[JUDGE_FALLBACK.index(name) + 1:]] if name in JUDGE_FALLBACK else [name]


def open_judge(name: str, args, queue: int):
    """``(engine, name)``: the first of :func:`judge_candidates` that loads (not started).

    Raises:
        ModelNotInstalled or ValueError: the last candidate's load error.
    """
    from pipeline.model_files import ModelNotInstalled

    candidates = judge_candidates(name)
    for i, cand in enumerate(candidates):
        try:
            return _engine(cand, args, queue), cand
        except (ModelNotInstalled, ValueError) as exc:
            if i + 1 == len(candidates) or (isinstance(exc, ValueError) and "unknown LLM" not in str(exc)):
                raise
            print(f"voxpipe bench quality: judge {cand} not available ({exc}); trying {candidates[i + 1]}",
                  file=sys.stderr)
    raise AssertionError("unreachable")


def judge_rows(engine, rows: list[Row], concurrency: int) -> None:
    """Fill each row's results' judge scores and its ``judge_mean`` (a started judge engine)."""
    for row in rows:
        todo = [r for r in row.results if r.judged]
        for r, s in zip(todo, asyncio.run(judge_all(engine, [(r.text, r.reply, r.history) for r in todo],
                                                    concurrency))):
            r.judge = s
        fresh = summarize(row.model, row.framing, row.results)
        row.judge_mean, row.unparsed = fresh.judge_mean, fresh.unparsed


def judge_agreement(engine, concurrency: int) -> tuple[Agreement, list[int | None]]:
    """The judge (a started engine) on the hand labels: the agreement and its scores in order."""
    labels = load_labels()
    scores = asyncio.run(judge_all(engine, [(x.user, x.reply, []) for x in labels], concurrency))
    return agreement([x.label for x in labels], scores), scores


def run_quality(models: list[str], names: list[str], items: list[Item], args, *,
                with_agreement: bool = True) -> tuple[list[Row], str, Agreement | None]:
    """Every model × framing on ``items``, judged: ``(rows, judge's name, agreement or None)``."""
    rows = [summarize(m, name, res) for m in models for name, res in run_model(m, names, items, args)]
    engine, judge = open_judge(args.judge, args, 64 + len(items))
    engine.start()
    try:
        judge_rows(engine, rows, args.concurrency)
        agree = judge_agreement(engine, args.concurrency)[0] if with_agreement else None
    finally:
        engine.stop()
    return rows, judge, agree


def _pct(k: int, n: int) -> str:
    return f"{k}/{n} {k / n:.0%}" if n else "-"


def format_table(rows: list[Row], judge: str, agree: Agreement | None) -> str:
    """The Markdown table (one row per model × framing) and the judge's agreement line."""
    head = ["model", "framing", "n", "fact acc", "rule pass", "parrot", "empty/trunc", "words",
            f"judge ({judge})", "judge agreement"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        judged = "-" if r.judge_mean is None else f"{r.judge_mean:.2f} (n={r.judged - r.unparsed})"
        lines.append("| " + " | ".join([
            r.model, r.framing, str(r.n), _pct(*r.fact), _pct(*r.rules), _pct(r.parrots, r.n),
            f"{r.empty}/{r.truncated}", f"{r.mean_words}", judged, agree.short() if agree else "-"]) + " |")
    if agree:
        lines.append(f"judge {judge} against {agree.n + agree.unparsed} hand labels: {agree.line()}")
    return "\n".join(lines)


def failures(row: Row, show: int) -> list[str]:
    """Up to ``show`` examples each of fact misses, rule failures and judge scores ≤ 2."""
    out = []
    pick = [("FACT", [r for r in row.results if r.fact is False]),
            ("RULES", [r for r in row.results if r.failed]),
            ("JUDGE", [r for r in row.results if r.judge is not None and r.judge <= 2])]
    for tag, bad in pick:
        for r in bad[:show]:
            why = ",".join(r.failed or []) if tag == "RULES" else f"{r.judge}" if tag == "JUDGE" else "miss"
            out.append(f"  [{row.model} {row.framing}] {tag} {why} {r.text!r} -> {r.reply[:160]!r}")
    return out


def add_arguments(p) -> None:
    """``voxpipe bench quality`` options."""
    p.add_argument("--llm", default="qwen,smollm2", help="models, comma-separated: any name load_llm accepts "
                                                           "(qwen,smollm2)")
    p.add_argument("--framing", default="server", help=f"framings, comma-separated ({', '.join(framings())}; "
                                                        "default server)")
    p.add_argument("--classes", default=",".join(CLASSES), help=f"item classes ({','.join(CLASSES)})")
    p.add_argument("--judge", default=JUDGE_FALLBACK[0],
                   help=f"the judge LLM ({JUDGE_FALLBACK[0]}; falls back along {' → '.join(JUDGE_FALLBACK)} "
                        "when not installed)")
    p.add_argument("--agreement", action="store_true", help="only the judge's agreement with the 30 hand labels")
    p.add_argument("--device", default=LlmConfig().device,
                   help="auto (the serving default), cpu (bf16), cpu-int4, cpu-fp32, cuda, ...")
    p.add_argument("--threads", type=int, default=LlmConfig().threads)
    p.add_argument("--concurrency", type=int, default=8, help="replies (and judge calls) generated together (8)")
    p.add_argument("--limit", type=int, default=0, help="only the first N items of each class (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=LlmConfig().max_new_tokens)
    p.add_argument("--show", type=int, default=3, help="failures of each kind printed per row (3)")
    p.add_argument("--json", action="store_true", help="print one JSON object (rows with every reply)")


def main(args) -> int:
    """``voxpipe bench quality``: print the table (or JSON with ``--json``); 2 on a bad option."""
    table = framings()
    names = args.framing.split(",")
    classes = tuple(args.classes.split(","))
    bad = [n for n in names if n not in table] + [c for c in classes if c not in CLASSES]
    if bad:
        print(f"voxpipe bench quality: unknown framing or class {', '.join(bad)}", file=sys.stderr)
        return 2
    if args.agreement:
        engine, judge = open_judge(args.judge, args, 64)
        engine.start()
        try:
            agreed, scores = judge_agreement(engine, args.concurrency)
        finally:
            engine.stop()
        if args.json:
            print(json.dumps({"judge": judge, "agreement": asdict(agreed), "scores": scores}))
        else:
            print(f"judge {judge} against {agreed.n + agreed.unparsed} hand labels: {agreed.line()}")
        return 0
    items = load_items(classes=classes, limit=args.limit)
    rows, judge, agree = run_quality(args.llm.split(","), names, items, args)
    if args.json:
        print(json.dumps({"judge": judge, "agreement": asdict(agree) if agree else None,
                          "rows": [asdict(r) for r in rows]}, ensure_ascii=False))
    else:
        print(format_table(rows, judge, agree))
        for r in rows:
            print("\n".join(failures(r, args.show)))
    return 0
