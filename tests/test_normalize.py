"""Units, money, numbers and abbreviations said as words before synthesis
(pipeline/tts/normalize.py), and what the voice then says (Piper → Whisper)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from audio.pcm import resample
from pipeline.tts.normalize import verbalize


@pytest.mark.parametrize("raw, said", [
    ("It is 98.6°F.", "It is ninety-eight point six degrees Fahrenheit."),
    ("Water boils at 100 °C", "Water boils at one hundred degrees Celsius"),
    ("It is -5°C outside.", "It is minus five degrees Celsius outside."),
    ("Turn it 1° left.", "Turn it one degree left."),
    ("That costs $19.99.", "That costs nineteen dollars and ninety-nine cents."),
    ("Only $1, or €0.50.", "Only one dollar, or fifty cents."),
    ("It raised $2.5 million.", "It raised two point five million dollars."),
    ("£5 each", "five pounds each"),
    ("Battery at 45%.", "Battery at forty-five percent."),
    ("It is 5 km away, 1 km from the lake.", "It is five kilometers away, one kilometer from the lake."),
    ("Drive at 60 mph or 100 km/h.", "Drive at sixty miles per hour or one hundred kilometers per hour."),
    ("A 2 GB file and 500 ms of delay.", "A two gigabytes file and five hundred milliseconds of delay."),
    ("Meet at 9:30 pm, 10:05 or 9:00.", "Meet at nine thirty P M, ten oh five or nine o'clock."),
    ("She came 21st of 1,000 in 1999.", "She came twenty-first of one thousand in nineteen ninety-nine."),
    ("The 3rd time.", "The third time."),
    ("Dr. Smith lives at No. 5, e.g. near us.", "Doctor Smith lives at number five, for example near us."),
    ("Python 3.11", "Python three point one one"),
    ("I have 2 cats.", "I have two cats."),
])
def test_verbalize(raw, said):
    assert verbalize(raw) == said


@pytest.mark.parametrize("kept", [
    "version 1.2.3", "an mp3 file", "COVID-19", "Call 555-1234.", "No thanks.", "St. Louis", "v2 of it",
    "1" * 40,  # longer than num2words should read: left as digits
])
def test_verbalize_leaves_alone(kept):
    assert verbalize(kept) == kept


@given(st.text(max_size=200))
def test_verbalize_never_raises_and_keeps_plain_words(text):
    out = verbalize(text)
    assert isinstance(out, str)
    if not any(ch.isdigit() or ch in "$€£¥%°." for ch in text):
        assert out == text


@pytest.mark.slow
def test_piper_says_the_units_it_is_given():
    """Through the real voice and back through real Whisper: "98.6°F" is heard as
    degrees Fahrenheit (before: "98.6 F"), and the percentage as percent."""
    from pipeline.asr.engine import AsrEngine
    from pipeline.asr.loader import load_whisper
    from pipeline.asr.types import AsrRequest
    from pipeline.config import AsrConfig, TtsConfig
    from pipeline.tts.engine import TtsEngine
    from pipeline.tts.loader import load_voice

    tts = TtsEngine(load_voice(TtsConfig()), TtsConfig())
    speech = tts.synthesize("Your temperature is 98.6°F and the battery is at 45%.")
    asr_cfg = AsrConfig()
    asr = AsrEngine(load_whisper(asr_cfg), asr_cfg)
    asr.start()
    try:
        heard = asyncio.run(asr.run(AsrRequest(resample(speech.audio, speech.sample_rate, 16000)))).text.lower()
    finally:
        asr.stop()
    assert "degrees" in heard and "fahrenheit" in heard, heard
    assert "percent" in heard or "45%" in heard, heard  # Whisper writes "percent" as "%"
