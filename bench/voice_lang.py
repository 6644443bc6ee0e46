"""``voxpipe bench voice --lang en de``: the voice benchmark per spoken language (issue 35).

One server with the multilingual Whisper (``--asr-model base`` unless ``--serve-args`` names
another) and a voice per language (joe for English, espeak-ng's otherwise: :func:`serve_args`)
plays each language's clips of the test audio folder (``manifest.tsv``'s
``language`` column; the "hard" clips left out), one ``voxpipe ask`` per clip at real-time
pace, one after another, and prints a row per language:

- **WER** of the final transcript against the manifest's reference, over the language's
  turns that got one (``heard``; a turn refused before its final has none) (jiwer; both
  sides through Whisper's normalisers from transformers: the English one
  for ``en``, the basic one, diacritics kept, otherwise);
- **detected**: the heard turns whose ``transcript.final.language`` was the clip's (%);
- **reply in language**: the answered turns whose reply :func:`bench.language_judge.judge`
  says is in the clip's language, among the languages benchmarked and English (%);
- **v2v p50**: the client's voice-to-voice, end of speech → first reply audio (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.language_judge import judge
from bench.server import free_port, start_server, stop_server

TURN_TIMEOUT_S = 180.0
"""How long one turn may take (s): a 1.5B LLM on two loaded cores is slow."""


@dataclass(slots=True)
class LangTurn:
    """One clip's turn. Times in ms."""

    language: str  # the clip's (manifest), ISO 639-1
    clip: str
    reference: str  # the manifest's reference transcript
    transcript: str = ""  # the server's final transcript ("" if none)
    detected: str | None = None  # transcript.final's language
    reply: str = ""  # the reply's text ("" if none)
    reply_language: str | None = None  # the judge's verdict on the reply; None: no reply or no evidence
    voice_to_voice: float | None = None  # end of speech → first reply audio at the client
    outcome: str = "error"  # "answered" | "busy" | "empty" | "error"
    busy: str | None = None  # the ``busy`` reason, if the turn was refused
    heard: bool = False  # a transcript.final came


def language_clips(audio_dir: Path, languages: list[str]) -> dict[str, list[dict[str, str]]]:
    """The manifest rows (``file``, ``reference_transcript``, ...) of each language's clips,
    less the "hard" ones, in the manifest's order.

    Raises:
        ValueError: a language has no clip in ``audio_dir/manifest.tsv``.
    """
    with open(audio_dir / "manifest.tsv", newline="", encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh, delimiter="\t") if "hard" not in r["file"]]
    out = {lang: [r for r in rows if r["language"] == lang] for lang in languages}
    missing = [lang for lang, clips in out.items() if not clips]
    if missing:
        raise ValueError(f"no clips for {missing} in {audio_dir / 'manifest.tsv'}")
    return out


def wer(language: str, refs: list[str], hyps: list[str]) -> float:
    """Corpus word error rate of ``hyps`` against ``refs`` (0..; 1.0 for no words heard),
    both normalised as Whisper's evaluation does (transformers' ``EnglishTextNormalizer`` for
    ``en``, ``BasicTextNormalizer`` otherwise)."""
    import jiwer
    from transformers.models.whisper.english_normalizer import BasicTextNormalizer, EnglishTextNormalizer

    norm = EnglishTextNormalizer({}) if language == "en" else BasicTextNormalizer()
    return float(jiwer.wer([" ".join(norm(r).split()) for r in refs],
                           [" ".join(norm(h).split()) or "-" for h in hyps]))


async def lang_turn(url: str, path: Path, row: dict[str, str], candidates: tuple[str, ...],
                    timeout_s: float = TURN_TIMEOUT_S) -> LangTurn:
    """Play one clip (its manifest ``row``) as a ``voxpipe ask`` on a new connection and
    judge the reply's language among ``candidates``; a timeout or a refused connection is an
    ``error`` turn."""
    from clients.client import ServerUnavailable, ask

    turn = LangTurn(row["language"], row["file"], row["reference_transcript"])
    try:
        res = await ask(str(path), url=url, timeout_s=timeout_s)
    except (TimeoutError, ServerUnavailable, OSError):
        return turn
    finals = [e for e in res.events if e.get("type") == "transcript.final"]
    if finals:
        turn.transcript, turn.detected = finals[-1].get("text", ""), finals[-1].get("language")
        turn.heard = True
    if any(e.get("type") == "response.done" for e in res.events):
        turn.outcome, turn.reply = "answered", res.reply_text
        turn.reply_language = judge(res.reply_text, candidates).language
        turn.voice_to_voice = res.timings_ms.get("voice_to_voice")
    elif res.busy is not None:
        turn.outcome, turn.busy = "busy", res.busy.get("reason")
    elif res.empty_reason is not None:
        turn.outcome = "empty"
    return turn


async def run_turns(url: str, audio_dir: Path, clips: dict[str, list[dict[str, str]]], repeat: int = 1,
                    ) -> list[LangTurn]:
    """Every language's clips, ``repeat`` times, one turn after another (languages take turns
    clip by clip, so drift hits them alike)."""
    candidates = tuple(sorted({"en", *clips}))
    out: list[LangTurn] = []
    longest = max(len(rows) for rows in clips.values())
    for _ in range(repeat):
        for i in range(longest):
            for rows in clips.values():
                if i < len(rows):
                    out.append(await lang_turn(url, audio_dir / rows[i]["file"], rows[i], candidates))
    return out


@dataclass(slots=True)
class LangRow:
    """One language's row of the table."""

    language: str
    turns: int
    heard: int  # turns with a final transcript
    answered: int
    wer: float | None  # corpus WER of the heard turns' finals (None: none heard)
    detected: float | None  # fraction of the heard turns whose detected language was the clip's, 0..1
    reply_correct: float | None  # fraction of the answered turns whose reply is in it, 0..1
    v2v_p50: float | None  # ms; None: nothing answered


def summary(turns: list[LangTurn], languages: list[str]) -> list[LangRow]:
    """A row per language of ``languages``, in that order (None where there was nothing to
    measure)."""
    table: list[LangRow] = []
    for lang in languages:
        mine = [t for t in turns if t.language == lang]
        heard = [t for t in mine if t.heard]
        answered = [t for t in mine if t.outcome == "answered"]
        v2v = [t.voice_to_voice for t in answered if t.voice_to_voice is not None]
        table.append(LangRow(
            lang, len(mine), len(heard), len(answered),
            wer(lang, [t.reference for t in heard], [t.transcript for t in heard]) if heard else None,
            sum(t.detected == lang for t in heard) / len(heard) if heard else None,
            sum(t.reply_language == lang for t in answered) / len(answered) if answered else None,
            statistics.median(v2v) if v2v else None))
    return table


def _cell(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def format_table(table: list[LangRow]) -> str:
    """The rows of :func:`summary` as a Markdown table (a dash where nothing was measured)."""
    lines = ["| language | turns | heard | answered | WER | detected | reply in language | v2v p50 ms |",
             "|---|---|---|---|---|---|---|---|"]
    for r in table:
        pct = [_cell(None if x is None else 100 * x, ".0f") for x in (r.detected, r.reply_correct)]
        pct = [p if p == "–" else f"{p} %" for p in pct]
        lines.append(f"| {r.language} | {r.turns} | {r.heard} | {r.answered} | {_cell(r.wer, '.3f')} | "
                     f"{pct[0]} | {pct[1]} | {_cell(r.v2v_p50, '.0f')} |")
    return "\n".join(lines)


def serve_args(extra: list[str], languages: list[str] = []) -> list[str]:  # noqa: B006 (read only)
    """``extra`` with ``--asr-model base`` prepended unless it names an ASR model itself, and a
    voice per language of ``languages`` unless it names a ``--voice`` itself: joe for English,
    espeak-ng's voice of that code for any other (``de=espeak:de``), so each reply is spoken in
    its own language."""
    voices = [] if any(a.startswith("--voice") for a in extra) else \
        [a for lang in languages for a in ("--voice", "en=joe" if lang == "en" else f"{lang}=espeak:{lang}")]
    asr = [] if any(a.startswith("--asr-model") for a in extra) else ["--asr-model", "base"]
    return [*asr, *voices, *extra]


def lang_main(args: argparse.Namespace) -> int:
    """``voxpipe bench voice --lang CODE ...``: start the server, run the turns, print the
    table (and each turn's transcript and reply under it); ``--max-clips N`` keeps each
    language's first N clips. 2 if a language has no clip."""
    audio_dir = Path(args.audio_dir)
    try:
        clips = language_clips(audio_dir, args.lang)
    except ValueError as exc:
        print(exc)
        return 2
    if args.max_clips is not None:
        clips = {lang: rows[: args.max_clips] for lang, rows in clips.items()}
    port = free_port()
    flags = serve_args(args.serve_args.split(), list(args.lang))
    proc = start_server(args.llm, port, flags, log=args.server_log)
    try:
        turns = asyncio.run(run_turns(f"ws://127.0.0.1:{port}/ws", audio_dir, clips, args.repeat))
    finally:
        stop_server(proc)
    print(f"LLM={args.llm}, server flags: {' '.join(flags)}; per language: WER of the final "
          "transcript and turns whose detected language was the clip's (of the heard turns: a final came), answered "
          "turns whose reply is in it "
          "(py3langid), client voice-to-voice p50")
    print(format_table(summary(turns, args.lang)))
    for t in turns:
        why = f" ({t.busy})" if t.busy else ""
        print(f"  {t.language} {t.clip}: {t.outcome}{why}, heard [{t.detected}] {t.transcript!r} -> "
              f"[{t.reply_language}] {t.reply!r}")
    return 0
