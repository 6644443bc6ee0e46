"""Piper's onnxruntime memory stays bounded over many phrases (issue 37;
pipeline/tts/arena.py), with the real voice."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnxruntime
import pytest

from pipeline.config import TtsConfig
from pipeline.tts.arena import SHRINK_KEY, ShrinkingSession
from pipeline.tts.engine import TtsEngine
from pipeline.tts.loader import load_voice

GROWTH_SCRIPT = textwrap.dedent("""
    import json, random, sys
    from pipeline.config import TtsConfig
    from pipeline.tts.engine import TtsEngine
    from pipeline.tts.loader import load_voice

    def anon_mb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon"):
                return int(line.split()[1]) / 1024

    cfg = TtsConfig(bounded_arena=sys.argv[1] == "bounded")
    voice = load_voice(cfg)
    engine = TtsEngine(voice, cfg)
    words = "the a cat dog house window morning weather rain train station ticket coffee table people".split()
    rng = random.Random(0)
    list(voice.synthesize("Hello."))
    before = anon_mb()
    for _ in range(40):
        list(voice.synthesize(" ".join(rng.choice(words) for _ in range(rng.randint(3, 30))) + "."))
    engine.on_idle()  # what the stage's worker does after a second without a phrase
    print(json.dumps({"growth_mb": anon_mb() - before}))
""")
GROWTH_LIMIT_MB = 60
"""Anonymous memory 40 phrases and the idle shrink may add with the bounded arena (2 MB
measured; 248 MB with onnxruntime's defaults, which keep growing after that)."""


def test_the_voice_runs_through_a_shrinking_session_with_no_memory_pattern():
    voice = load_voice(TtsConfig())
    assert isinstance(voice.session, ShrinkingSession)
    assert voice.session.get_session_options().enable_mem_pattern is False
    plain = load_voice(TtsConfig(bounded_arena=False))
    assert isinstance(plain.session, onnxruntime.InferenceSession)
    cfg = TtsConfig()
    a = TtsEngine(voice, cfg).synthesize("The train leaves at seven.").audio
    b = TtsEngine(plain, cfg).synthesize("The train leaves at seven.").audio
    assert a.size > 8000 and a.shape == b.shape and np.allclose(a, b, atol=1e-4)  # the same speech


def test_a_callers_run_options_also_shrink_once_asked():
    voice = load_voice(TtsConfig())
    voice.session.shrink_next()
    mine = onnxruntime.RunOptions()
    ids = np.array([[1, 20, 30, 40, 2]], dtype=np.int64)
    feeds = {"input": ids, "input_lengths": np.array([ids.shape[1]], dtype=np.int64),
             "scales": np.array([0.667, 1.0, 0.8], dtype=np.float32)}
    out = voice.session.run(None, feeds, mine)
    assert out[0].size > 0 and mine.get_run_config_entry(SHRINK_KEY) == "cpu:0"
    later = onnxruntime.RunOptions()
    voice.session.run(None, feeds, later)  # only the next run shrinks
    with pytest.raises(RuntimeError):
        later.get_run_config_entry(SHRINK_KEY)


def test_the_tts_stage_shrinks_once_it_goes_idle():
    engine = TtsEngine(load_voice(TtsConfig()), TtsConfig())
    assert engine.idle_after_s is not None and engine.idle_after_s > 0
    assert TtsEngine(load_voice(TtsConfig(bounded_arena=False)), TtsConfig()).idle_after_s is None
    engine.on_idle()  # a real one-word run with the shrink entry: no error, nothing left pending
    assert engine.voice.session._pending is False


def test_forty_phrases_leave_the_memory_bounded():
    """In a fresh process, 40 phrases then the idle hook: the bounded arena keeps 2 MB,
    onnxruntime's defaults 248 MB (one run each)."""
    run = subprocess.run([sys.executable, "-c", GROWTH_SCRIPT, "bounded"], capture_output=True, text=True, timeout=600,
                         check=True)
    growth = json.loads(run.stdout.strip().splitlines()[-1])["growth_mb"]
    assert growth < GROWTH_LIMIT_MB, growth
