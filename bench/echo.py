"""``voxpipe bench echo``: ``voxpipe mic`` without headphones, run after run (issue 36).

Starts ``voxpipe serve --llm LLM``, then for each leak level (``--leak-db``, the speaker's level
at the microphone: :func:`bench.pulse_room.pulse_room`) runs ``--runs`` conversations, each in a
fresh PulseAudio room with a fresh ``voxpipe mic --echo MODE`` (so the echo canceller starts
cold every time, as on a new session). A run:

1. waits a random 0-1.5 s, then plays a question clip into the room as the human (the
   English clips but JFK's, which is the barge-in voice, rotate run by run); the room and
   the speaker are recorded meanwhile (``parec``);
2. waits for the reply to end (its latency line, or an interruption), then listens
   ``--quiet-s`` more;
3. plays another question, waits until its reply is playing, 2.5 s more (past the merge window),
   then a human voice ``--human-over-db`` over the leaked reply level, and waits for that reply
   to end (:func:`barge_in`). A reply that ended before the voice began, or less than
   :data:`OVERLAP_S` after, was too short to be cut: the run asks the next question and
   tries again, up to :data:`BARGE_TRIES` questions.

Per run it counts: replies cut with no human talking (the assistant's own voice cut it: ``self-cut``),
``you:`` turns beyond the questions (``self-answered``), the words of the first ``you:`` line
that the reply said and the speaker did not (``leaked words``, :func:`leaked`), whether the
human cut the reply it talked over, and the first reply's voice-to-voice delay as heard in
the room (:func:`heard_v2v_ms`) and as the server measured it (its latency line). A last row
runs ``--headphones-runs`` with ``--echo off`` and no leak at all; ``--controls`` adds as many
with ``--echo MODE`` and no leak (the echo control's own cost, without the room's echo).
The rows take turns, run by run (:func:`run_plan`).

Prints one row per level: runs, sums, the barge-ins that worked, the v2v p50 (and max), and
the v2v and the client path (heard minus server's v2v) over headphones, paired by clip.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.common import english_rows
from bench.pulse_room import play_as_human, pulse_room, scaled_copy
from bench.server import free_port, start_server, stop_server

REPLY_DBFS = -19.5
"""Piper's joe voice: RMS over its voiced 20 ms blocks (dBFS), the level its echo has at 0 dB."""
BLOCK_S = 0.02
SPEECH_DBFS = -40.0
"""A block of the question above this is speech (its end: the last such block)."""
PLAYBACK_DBFS = -45.0
"""A block of the speaker's recording above this is the reply playing."""
REC_RATE = 16000
HUMAN_VOICE = "en_jfk_inaugural_1961.wav"
"""The barge-in voice; never a question (its long pauses would make turns of their own)."""
MERGE_S = 2.5
"""Wait after the second reply starts before the human talks: past the 2 s merge window."""
OVERLAP_S = 2.0
"""A reply that ends normally less than this after the human voice's file began was too short
to cut; one that ends later was missed. The voice's first word is 0.36 s into the file, and
the server cancels on a partial transcript with words once the speech over the reply has
lasted ``barge_in_min_ms`` (400 ms), seen 250 ms into it: about 1-1.5 s in all."""
BARGE_TRIES = 5
"""Questions asked at most for a reply long enough to talk over (the other questions in turn,
never the run's first): with 3, one clip's three (3752-4944-0000's) all had replies too
short, in 3 runs of 30 (``voxpipe bench echo`` at d0da8cd), which then had no verdict."""
SETTLE_S = 2.0
"""Before another try: the client listening, with nothing new printed, this long."""


@dataclass(slots=True)
class Run:
    """One conversation's counts (see the module docstring)."""

    leak_db: float | None
    echo: str
    clip: str
    self_cut: int = 0
    self_answered: int = 0
    leaked_words: int = 0
    heard: bool = False  # the first question got its ``you:`` line
    barge_in: bool | None = None  # None: step 3 not reached, or no reply long enough
    barge_tries: int = 0  # questions asked in step 3
    v2v_ms: float | None = None
    server_v2v_ms: float | None = None  # the first reply's, from the client's latency line
    error: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llm", default="smollm2", help="the server's --llm (smollm2)")
    p.add_argument("--leak-db", default="0,-20,-35", help="leak levels in dB, comma-separated (0,-20,-35)")
    p.add_argument("--runs", type=int, default=10, help="runs per level (10)")
    p.add_argument("--headphones-runs", type=int, default=3, help="runs with --echo off and no leak (3)")
    p.add_argument("--echo", default="auto", help="voxpipe mic --echo (auto)")
    p.add_argument("--quiet-s", type=float, default=20.0, help="listen this long after the first reply (20)")
    p.add_argument("--human-over-db", type=float, default=10.0, help="the barge-in voice over the leak (10 dB)")
    p.add_argument("--controls", action="store_true",
                   help="add --headphones-runs runs with --echo MODE and no leak (the echo control's own cost)")
    p.add_argument("--server-log", default=None, help="write the server's INFO log to this file")
    p.add_argument("--serve-args", default="", help="extra 'voxpipe serve' options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--audio-dir", default=str(Path(__file__).resolve().parent.parent / "tests" / "data" / "audio"))
    p.add_argument("--keep", default=None, help="keep each run's client output in this folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def words(text: str) -> list[str]:
    """Lower-case words of ``text`` (letters, digits and apostrophes)."""
    return re.findall(r"[a-z0-9']+", text.lower())


def leaked(heard: str, reference: str, reply: str) -> int:
    """Words of ``heard`` (the user's transcript) that the alignment with ``reference`` finds
    inserted (not misheard in place of a word said: "Freer" for "Frere" is the ASR's) and that
    ``reply`` holds: the reply's echo taken for the user's words."""
    import difflib

    got, ref, said = words(heard), words(reference), set(words(reply))
    ops = difflib.SequenceMatcher(a=ref, b=got, autojunk=False).get_opcodes()
    extra = [w for tag, i1, i2, j1, j2 in ops
             if tag == "insert" or (tag == "replace" and j2 - j1 > i2 - i1) for w in got[j1:j2]]
    return sum(1 for w in extra if w in said)


def block_dbfs(x: np.ndarray, rate: int) -> np.ndarray:
    """RMS level (dBFS) of each :data:`BLOCK_S` block of ``x`` (float, mono)."""
    n = int(rate * BLOCK_S)
    blocks = x[: len(x) // n * n].reshape(-1, n) if len(x) >= n else np.zeros((0, n), np.float32)
    return 20 * np.log10(np.sqrt(np.mean(np.square(blocks), axis=1)) + 1e-9)


def speech_end_s(path: Path) -> float:
    """Where the clip's speech ends (s): the end of its last block above :data:`SPEECH_DBFS`."""
    import soundfile as sf

    data, rate = sf.read(str(path), dtype="float32", always_2d=True)
    level = block_dbfs(data.mean(axis=1), rate)
    loud = np.nonzero(level > SPEECH_DBFS)[0]
    return float((loud[-1] + 1) * BLOCK_S) if loud.size else 0.0


def first_sound_s(raw: Path, after_s: float, dbfs: float = PLAYBACK_DBFS) -> float | None:
    """The first block of the s16le mono :data:`REC_RATE` recording ``raw`` above ``dbfs`` at
    or after ``after_s`` (s from the recording's start), or None."""
    x = np.frombuffer(raw.read_bytes(), dtype="<i2").astype(np.float32) / 32768
    level = block_dbfs(x, REC_RATE)
    start = max(0, int(after_s / BLOCK_S))
    loud = np.nonzero(level[start:] > dbfs)[0]
    return float((start + loud[0]) * BLOCK_S) if loud.size else None


def heard_v2v_ms(speaker: Path, room: Path, question: Path) -> float | None:
    """The first reply's delay as heard (ms): from the end of the question's speech to the
    reply's first sound. The question starts at the room recording's first sound (nothing
    plays before it) and its speech ends :func:`speech_end_s` later; the reply starts at the
    speaker recording's first sound after that. Both recordings start together (two
    ``parec`` started back to back). None when either is not found."""
    start = first_sound_s(room, 0.0, SPEECH_DBFS)
    if start is None:
        return None
    end = start + speech_end_s(question)
    reply = first_sound_s(speaker, end)
    return None if reply is None else round((reply - end) * 1000)


def _wait_for(log: Path, pred, timeout_s: float) -> str | None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = log.read_text(errors="replace")
        if pred(text):
            return text
        time.sleep(0.1)
    return None


def you_lines(text: str) -> list[str]:
    """The user's transcripts in ``voxpipe mic``'s output (its ``you:`` lines, prefix removed)."""
    return [ln[5:] for ln in text.splitlines() if ln.startswith("you: ")]


def reply_text(text: str) -> str:
    """The replies' words in ``voxpipe mic``'s output (its ``voxpipe:`` lines, joined)."""
    return " ".join(ln[9:] for ln in text.splitlines() if ln.startswith("voxpipe: "))


def reply_end(text: str) -> str | None:
    """How the reply playing where ``text`` (``voxpipe mic``'s output from then on) starts
    ended: ``"cut"`` (an ``(interrupted: ...)`` line, whatever the reason), ``"done"`` (its
    latency line first), or None (not yet)."""
    cut, done = text.find("(interrupted"), text.find("latency:")
    if cut >= 0 and (done < 0 or cut < done):
        return "cut"
    return "done" if done >= 0 else None


def server_v2v_ms(text: str) -> float | None:
    """The first ``latency: voice-to-voice N ms`` of ``voxpipe mic``'s output (ms), or None."""
    m = re.search(r"latency: voice-to-voice (\d+) ms", text)
    return float(m.group(1)) if m else None


def barge_in(out: Path, env: dict[str, str], question: Path, human: Path) -> str:
    """Ask ``question``; :data:`MERGE_S` into its reply, play ``human`` over it and wait
    for the reply to end. Returns ``"cut"``; ``"missed"`` (it ended normally
    :data:`OVERLAP_S` or more after the voice began); ``"short"`` (it ended before, or
    sooner); ``"self-cut"`` (it was cut before the voice began); ``"no reply"``."""
    before_you = len(you_lines(out.read_text(errors="replace")))
    play_as_human(env, question)
    playing = _wait_for(out, lambda t: len(you_lines(t)) > before_you and "[speaking]" in t.rsplit("you: ", 1)[1],
                        120)
    if playing is None:
        return "no reply"
    start = playing.rfind("you: ")
    time.sleep(MERGE_S)
    text = out.read_text(errors="replace")
    ended = reply_end(text[start:])
    if ended is not None:
        return "self-cut" if ended == "cut" else "short"
    mark, began = len(text), time.monotonic()
    voice = play_as_human(env, human, wait=False)
    end = _wait_for(out, lambda t: reply_end(t[mark:]) is not None, 60)
    took = time.monotonic() - began
    voice.terminate()  # the reply's fate is known: the rest of the voice would only make turns
    voice.wait(30)
    if end is not None and reply_end(end[mark:]) == "cut":
        return "cut"
    return "short" if end is not None and took < OVERLAP_S else "missed"


def settle(out: Path, timeout_s: float = 90.0) -> bool:
    """Wait until ``voxpipe mic`` is listening with nothing new printed for :data:`SETTLE_S`."""
    deadline = time.time() + timeout_s
    seen, since = "", time.monotonic()
    while time.time() < deadline:
        text = out.read_text(errors="replace")
        if text != seen:
            seen, since = text, time.monotonic()
        elif text.rstrip().endswith("[listening]") and time.monotonic() - since >= SETTLE_S:
            return True
        time.sleep(0.1)
    return False


def one_run(url: str, leak_db: float | None, echo: str, question: dict, others: list[dict], audio_dir: Path,
            args: argparse.Namespace, rng: random.Random, folder: Path) -> Run:
    """One conversation in a fresh room (see the module docstring); ``others``: step 3's
    questions, in order."""
    run = Run(leak_db, echo, question["file"])
    out, rec, room = folder / "mic.txt", folder / "speaker.raw", folder / "room.raw"
    human_dbfs = REPLY_DBFS + (leak_db or 0.0) + args.human_over_db
    voice = audio_dir / HUMAN_VOICE
    human = scaled_copy(voice, folder / "human.wav", human_dbfs - _clip_dbfs(voice))
    with pulse_room(folder / "pulse", leak_db) as env, open(out, "w") as fh:
        client = subprocess.Popen([sys.executable, "-m", "cli", "mic", "--url", url, "--echo", echo], env=env,
                                  stdout=fh, stderr=subprocess.STDOUT, text=True)
        recorders: list[subprocess.Popen] = []
        try:
            if _wait_for(out, lambda t: "[listening]" in t, 120) is None:
                run.error = "the client did not start"
                return run
            recorders = [subprocess.Popen(["parec", "-d", f"{sink}.monitor", "--format=s16le", f"--rate={REC_RATE}",
                                           "--channels=1", "--raw", str(path)], env=env)
                         for sink, path in (("speaker", rec), ("room", room))]
            time.sleep(rng.uniform(0.0, 1.5))
            play_as_human(env, audio_dir / question["file"])
            text = _wait_for(out, lambda t: "latency:" in t or "(interrupted" in t, 180)
            if text is None:
                run.error = "no reply"
                return run
            time.sleep(args.quiet_s)
            text = out.read_text(errors="replace")
            heard = you_lines(text)
            run.heard = bool(heard)
            run.self_answered = max(0, len(heard) - 1)
            run.self_cut = text.count("(interrupted")
            if heard:
                run.leaked_words = leaked(heard[0], question["reference_transcript"], reply_text(text))
            run.v2v_ms = heard_v2v_ms(rec, room, audio_dir / question["file"])
            run.server_v2v_ms = server_v2v_ms(text)
            for second in others[:BARGE_TRIES]:
                if run.barge_tries and not settle(out):
                    run.error = "the client did not settle"
                    break
                run.barge_tries += 1
                outcome = barge_in(out, env, audio_dir / second["file"], human)
                run.self_cut += outcome == "self-cut"
                if outcome in ("cut", "missed"):
                    run.barge_in = outcome == "cut"
                    break
        finally:
            for recorder in recorders:
                recorder.terminate()
                recorder.wait(10)
            if client.poll() is None:
                client.send_signal(signal.SIGINT)
            try:
                client.wait(30)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait()
    return run


def _clip_dbfs(path: Path) -> float:
    import soundfile as sf

    data, _ = sf.read(str(path), dtype="float32")
    return float(20 * np.log10(np.sqrt(np.mean(np.square(data))) + 1e-9))


def is_headphones(r: Run) -> bool:
    """The reference row: no leak and ``--echo off``."""
    return r.leak_db is None and r.echo == "off"


def over_headphones(rs: list[Run], runs: list[Run]) -> list[float]:
    """Each of ``rs``'s first-reply v2v minus the headphones runs' (of ``runs``) median v2v
    on the same question clip (ms), for the runs whose clip has one: a row's clips differ
    from the headphones row's, and a clip's reply sets most of its v2v."""
    phones: dict[str, list[float]] = {}
    for r in runs:
        if is_headphones(r) and r.v2v_ms is not None:
            phones.setdefault(r.clip, []).append(r.v2v_ms)
    return [r.v2v_ms - statistics.median(phones[r.clip]) for r in rs if r.v2v_ms is not None and r.clip in phones]


def client_over_headphones(rs: list[Run], runs: list[Run]) -> list[float]:
    """The same pairing as :func:`over_headphones` on each run's *client path*: its heard v2v
    minus the server's own (the microphone, the client's processing, the network and the
    speaker, without the server's run-to-run timing), minus the headphones runs' median of
    the same on that clip (ms). The heard v2v starts at the clip's speech end and the
    server's at its VAD's, so the path differs by clip, not by row."""
    def path(r: Run) -> float | None:
        return None if r.v2v_ms is None or r.server_v2v_ms is None else r.v2v_ms - r.server_v2v_ms

    phones: dict[str, list[float]] = {}
    for r in runs:
        if is_headphones(r) and (d := path(r)) is not None:
            phones.setdefault(r.clip, []).append(d)
    return [d - statistics.median(phones[r.clip]) for r in rs if (d := path(r)) is not None and r.clip in phones]


def _p50_max(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f} ({max(xs):.0f})" if xs else "-"


def format_table(runs: list[Run]) -> str:
    """One row per (leak, echo mode): sums over its runs, the v2v p50 (max) as heard and as
    the server measured it, the p50 of :func:`over_headphones` and of
    :func:`client_over_headphones` (with how many runs had a headphones run of their clip),
    and the barge-ins: cut / tried (questions asked)."""
    head = ["leak dB", "echo", "runs", "heard", "self-cut replies", "self-answered turns", "leaked words",
            "barge-in cut (questions)", "first-reply v2v p50 (max) ms", "server's v2v p50 (max) ms",
            "v2v − headphones, same clip, p50 ms (n)", "client path − headphones', same clip, p50 ms (n)",
            "errors"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r.leak_db, r.echo) for r in runs))
    for leak_db, echo in keys:
        rs = [r for r in runs if (r.leak_db, r.echo) == (leak_db, echo)]
        tried = [r for r in rs if r.barge_in is not None]
        over = [] if is_headphones(rs[0]) else over_headphones(rs, runs)
        path = [] if is_headphones(rs[0]) else client_over_headphones(rs, runs)
        label = "none (headphones)" if is_headphones(rs[0]) else "none" if leak_db is None else f"{leak_db:g}"
        lines.append("| " + " | ".join([
            label, echo, str(len(rs)),
            str(sum(r.heard for r in rs)), str(sum(r.self_cut for r in rs)), str(sum(r.self_answered for r in rs)),
            str(sum(r.leaked_words for r in rs)),
            f"{sum(bool(r.barge_in) for r in tried)}/{len(tried)} ({sum(r.barge_tries for r in rs)})",
            _p50_max([r.v2v_ms for r in rs if r.v2v_ms is not None]),
            _p50_max([r.server_v2v_ms for r in rs if r.server_v2v_ms is not None]),
            f"{statistics.median(over):+.0f} ({len(over)})" if over else "-",
            f"{statistics.median(path):+.0f} ({len(path)})" if path else "-",
            str(sum(bool(r.error) for r in rs))]) + " |")
    return "\n".join(lines)


def run_plan(levels: list[float], runs: int, echo: str, headphones_runs: int,
             controls: bool = False) -> list[tuple[float | None, str]]:
    """The (leak dB or None for no leak, echo mode) of each run, round-robin over the rows
    (the first run of every row, then the second, ...), so a machine's drift over the bench
    touches every row alike. ``controls``: a row of ``headphones_runs`` with ``echo`` and no
    leak, before the headphones row."""
    rows: list[list[tuple[float | None, str]]] = [[(db, echo)] * runs for db in levels]
    if controls:
        rows.append([(None, echo)] * headphones_runs)
    rows.append([(None, "off")] * headphones_runs)
    return [row[k] for k in range(max(map(len, rows))) for row in rows if k < len(row)]


def main(args: argparse.Namespace) -> int:
    """``voxpipe bench echo``: start the server, run every level, print the table."""
    levels = [float(x) for x in args.leak_db.split(",") if x.strip()]
    audio_dir = Path(args.audio_dir)
    rows = [r for r in english_rows(audio_dir) if r["file"] != HUMAN_VOICE]
    rng = random.Random(args.seed)
    port = free_port()
    proc = start_server(args.llm, port, args.serve_args.split(), log=args.server_log)
    runs: list[Run] = []
    plan = run_plan(levels, args.runs, args.echo, args.headphones_runs, args.controls)
    try:
        for i, (db, echo) in enumerate(plan):
            with tempfile.TemporaryDirectory() as tmp:
                others = [rows[(i + k) % len(rows)] for k in range(3, 3 + len(rows)) if k % len(rows)][:BARGE_TRIES]
                run = one_run(f"ws://127.0.0.1:{port}/ws", db, echo, rows[i % len(rows)], others, audio_dir, args,
                              rng, Path(tmp))
                if args.keep:
                    keep = Path(args.keep)
                    keep.mkdir(parents=True, exist_ok=True)
                    (keep / f"run{i:02d}.txt").write_text((Path(tmp) / "mic.txt").read_text(errors="replace"))
            runs.append(run)
            if not args.json:
                print(f"run {i + 1}/{len(plan)}: {json.dumps(asdict(run))}", flush=True)
    finally:
        stop_server(proc)
    if args.json:
        print(json.dumps({"llm": args.llm, "runs": [asdict(r) for r in runs]}, indent=1))
        return 0
    print(f"\nvoxpipe bench echo: --llm {args.llm}, voxpipe mic --echo {args.echo}, {args.runs} runs per level, "
          f"listening {args.quiet_s:g} s after the first reply, the barge-in voice {args.human_over_db:g} dB over "
          "the leak\n")
    print(format_table(runs))
    return 0
