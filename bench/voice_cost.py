"""``python -m bench.voice_cost``: what each extra ``--voice`` costs the TTS stage (issue 35).

Each configuration (a list of ``--voice`` entries) is measured in a fresh Python process, so
one's memory never counts in another's: the process imports the TTS stack (piper,
onnxruntime, num2words), reads its RSS (``/proc/self/status`` ``VmRSS``), loads the voices
with :func:`pipeline.tts.loader.load_voices` (timing each one), reads the RSS again, speaks one
sentence with every voice (onnxruntime's arena grows to a phrase's needs on the first run),
reads it a third time, and a fourth after the stage's idle shrink (a Piper voice's bounded
arena gives memory back, :mod:`pipeline.tts.arena`). Repeated ``--repeat`` times; the table shows medians.

Default configurations: ``joe`` alone; joe + espeak-ng German; joe + a second Piper voice
(joe's model copied under another name: the one Piper voice that installs offline, so the
cost of any medium-quality Piper voice, 63 MB of ONNX); joe + both.

Prints a Markdown table (MB = MiB): configuration, voices, load s (all voices), RSS after
load, after the first phrases and after the idle shrink (each over the RSS with the stack
imported), and the extra over ``joe`` alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1 << 20
SENTENCE = {"en": "The train leaves at 9:30 and costs 19.99 dollars.",
            "de": "Der Zug fährt um 9:30 Uhr und kostet 19,99 €."}
"""What each voice says once after loading (by its language; others: the English one)."""


def rss_bytes() -> int:
    """This process's resident set size (bytes), from ``/proc/self/status``."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(voices: list[str]) -> dict:
    """Load ``voices`` (``--voice`` entries) in this process and speak once with each:
    ``{"rss_base", "rss_loaded", "rss_spoken", "rss_idle"}`` (bytes; idle: after the stage's
    idle shrink, :meth:`~pipeline.tts.engine.TtsEngine.on_idle`), ``load_s`` (all voices) and
    ``load_s_each`` (s per voice, in order)."""
    import piper  # noqa: F401  (the TTS stack, imported before the baseline)

    from pipeline.config import TtsConfig
    from pipeline.tts.catalogue import parse_voices
    from pipeline.tts.engine import TtsEngine
    from pipeline.tts.loader import load_synth
    from pipeline.tts.normalize import verbalize
    from pipeline.tts.types import Phrase

    verbalize("1", "de")  # num2words' German tables
    cfg = TtsConfig(voices=tuple(voices))
    base = rss_bytes()
    synths, each = [], []
    for spec in parse_voices(cfg.voices):
        t0 = time.perf_counter()
        synths.append(load_synth(spec, cfg))
        each.append(time.perf_counter() - t0)
    loaded = rss_bytes()
    engine = TtsEngine(synths, cfg)
    for synth in synths:
        engine.speak(Phrase(SENTENCE.get(synth.info.language, SENTENCE["en"]), synth.info.name))
    spoken = rss_bytes()
    engine.on_idle()  # as the stage does after IDLE_SHRINK_S without a phrase (bounded arena)
    return {"rss_base": base, "rss_loaded": loaded, "rss_spoken": spoken, "rss_idle": rss_bytes(),
            "load_s": sum(each), "load_s_each": each}


def run_one(voices: list[str]) -> dict:
    """:func:`measure` in a fresh Python process."""
    out = subprocess.run([sys.executable, "-m", "bench.voice_cost", "--one", json.dumps(voices)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def configurations(folder: Path) -> dict[str, list[str]]:
    """The default configurations; a copy of joe's files goes into ``folder``."""
    from pipeline import model_files

    onnx, conf = model_files.piper_joe_files()
    second = folder / "en_US-joe2-medium.onnx"
    shutil.copyfile(onnx, second)
    shutil.copyfile(conf, folder / "en_US-joe2-medium.onnx.json")
    return {"joe": ["en=joe"], "joe + espeak-de": ["en=joe", "de=espeak:de"],
            "joe + 2nd Piper": ["en=joe", f"en={second}"],
            "joe + 2nd Piper + espeak-de": ["en=joe", f"en={second}", "de=espeak:de"]}


def table(rows: dict[str, list[dict]]) -> str:
    """The Markdown table of the medians of each configuration's runs."""
    def med(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    head = ("| configuration | voices | load s (each) | RSS loaded MB | after a phrase each MB | idle MB | "
            "extra over joe: loaded / phrase / idle MB |\n|---|---|---|---|---|---|---|")
    keys = ("rss_loaded", "rss_spoken", "rss_idle")

    def over_base(runs: list[dict]) -> list[float]:
        return [(med(runs, k) - med(runs, "rss_base")) / MIB for k in keys]

    ref = over_base(rows["joe"]) if "joe" in rows else None
    lines = [head]
    for name, runs in rows.items():
        mine = over_base(runs)
        extra = " / ".join(f"{a - b:+.1f}" for a, b in zip(mine, ref)) if ref and name != "joe" else "—"
        each = " + ".join(f"{statistics.median(r['load_s_each'][i] for r in runs):.2f}"
                          for i in range(len(runs[0]["load_s_each"])))
        lines.append(f"| {name} | {len(runs[0]['load_s_each'])} | {med(runs, 'load_s'):.2f} ({each}) | "
                     f"{mine[0]:.1f} | {mine[1]:.1f} | {mine[2]:.1f} | {extra} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.voice_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per configuration (median)")
    p.add_argument("--json", action="store_true", help="print every run as JSON instead of the table")
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one configuration, print JSON
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(measure(json.loads(args.one))))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows = {name: [run_one(voices) for _ in range(args.repeat)]
                for name, voices in configurations(Path(tmp)).items()}
    print(json.dumps(rows, indent=1) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
