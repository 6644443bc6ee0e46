"""Units, money, numbers and abbreviations said as words before synthesis, in English and
German (pipeline/tts/normalize.py, pipeline/tts/normalize_de.py), and what the voice then
says (Piper → Whisper)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from audio.pcm import resample
from pipeline.tts.normalize import verbalize


@pytest.mark.parametrize("raw, said", [
    ("Take 0,125 of it", "Take zero point one two five of it"),  # a group never starts with 0
    ("0,5% and 1,234", "zero point five percent and one thousand, two hundred and thirty-four"),
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


@pytest.mark.parametrize("language, raw, said", [
    ("en", "98,6 °F", "ninety-eight point six degrees Fahrenheit"),
    ("de", "98,6 °F", "achtundneunzig Komma sechs Grad Fahrenheit"),
    ("en", "19,99 €", "nineteen euros and ninety-nine cents"),
    ("de", "19,99 €", "neunzehn Euro neunundneunzig"),
    ("en", "3.14", "three point one four"),
    ("de", "3.14", "drei Komma eins vier"),
    ("en", "9 a.m.", "nine A M"),
    ("de", "9 a.m.", "neun Uhr"),
])
def test_the_issues_examples_in_both_languages(language, raw, said):
    assert verbalize(raw, language) == said


@pytest.mark.parametrize("raw, said", [
    ("0.125 Liter", "null Komma eins zwei fünf Liter"),  # a group never starts with 0
    ("1.234 und 0.001", "eintausendzweihundertvierunddreißig und null Komma null null eins"),
    ("Es sind 98,6 °F.", "Es sind achtundneunzig Komma sechs Grad Fahrenheit."),
    ("Heute 21 °C, nachts -5°C.", "Heute einundzwanzig Grad Celsius, nachts minus fünf Grad Celsius."),
    ("Nur 1 °C", "Nur ein Grad Celsius"),
    ("98.6°F", "achtundneunzig Komma sechs Grad Fahrenheit"),  # English-style decimal point
    ("Das kostet 19,99 €.", "Das kostet neunzehn Euro neunundneunzig."),
    ("5 €, € 5 oder 5€", "fünf Euro, fünf Euro oder fünf Euro"),
    ("1 € und 0,50 € und 1,00 €", "ein Euro und fünfzig Cent und ein Euro"),
    ("$19.99 oder 3 £", "neunzehn Dollar neunundneunzig oder drei Pfund"),
    ("19,99 Euro, EUR 5", "neunzehn Euro neunundneunzig, fünf Euro"),
    ("2,5 Mio. € und 1 Mio. €", "zwei Komma fünf Millionen Euro und eine Million Euro"),
    ("Akku bei 45 %, davor 1%.", "Akku bei fünfundvierzig Prozent, davor ein Prozent."),
    ("5 km weit, 1 km zum See", "fünf Kilometer weit, ein Kilometer zum See"),
    ("Mit 100 km/h oder 60 mph", "Mit einhundert Kilometer pro Stunde oder sechzig Meilen pro Stunde"),
    ("2,5 kg, 3 m, 1 h, 2 h, 500 ms", "zwei Komma fünf Kilogramm, drei Meter, eine Stunde, zwei Stunden, "
                                      "fünfhundert Millisekunden"),
    ("Um 9:30 Uhr, 9.30 Uhr, 9 Uhr, 1 Uhr oder 9:05", "Um neun Uhr dreißig, neun Uhr dreißig, neun Uhr, ein Uhr "
                                                       "oder neun Uhr fünf"),
    ("9:30 pm, 12 a.m. oder 9am", "einundzwanzig Uhr dreißig, null Uhr oder neun Uhr"),
    ("Wir treffen uns um 5 am Bahnhof.", "Wir treffen uns um fünf am Bahnhof."),  # "am": the German word
    ("Am 3. Oktober 2024", "Am dritten Oktober zweitausendvierundzwanzig"),
    ("3. Oktober", "dritter Oktober"),
    ("der 3. Platz im 19. Jahrhundert", "der dritte Platz im neunzehnten Jahrhundert"),
    ("Heute ist der 3.", "Heute ist der dritte."),
    ("Die Antwort ist 42. Möchtest du mehr?", "Die Antwort ist zweiundvierzig. Möchtest du mehr?"),
    ("1999 und 2024, aber 1.234.567", "neunzehnhundertneunundneunzig und zweitausendvierundzwanzig, aber "
                                      "eine Million zweihundertvierunddreißigtausendfünfhundertsiebenundsechzig"),
    ("3,14 und 1.234,5", "drei Komma eins vier und eintausendzweihundertvierunddreißig Komma fünf"),
    ("3.141 ist 3141, 3.1415 nicht", "dreitausendeinhunderteinundvierzig ist dreitausendeinhunderteinundvierzig, "
                                     "drei Komma eins vier eins fünf nicht"),
    ("z. B. Obst, z.B. Äpfel, d. h. ca. 5 Stück usw.", "zum Beispiel Obst, zum Beispiel Äpfel, das heißt circa "
                                                       "fünf Stück und so weiter"),
    ("Dr. Müller wohnt in Nr. 5 bzw. 7.", "Doktor Müller wohnt in Nummer fünf beziehungsweise sieben."),
    ("1 Million Einwohner, -3 Punkte", "eine Million Einwohner, minus drei Punkte"),
])
def test_verbalize_german(raw, said):
    assert verbalize(raw, "de") == said


@pytest.mark.parametrize("kept", [
    "Version 1.2.3", "am 3.10.2024", "eine mp3-Datei", "COVID-19", "Ruf 555-1234 an.", "Nr. sicher", "v2 davon",
    "1" * 40,
])
def test_verbalize_german_leaves_alone(kept):
    assert verbalize(kept, "de") == kept


@pytest.mark.parametrize("language", [None, "", "en", "EN", "en-US", "xx", "fr"])
def test_english_rules_for_english_none_and_unknown_codes(language):
    said = "It is ninety-eight point six degrees Fahrenheit, forty-five percent."
    assert verbalize("It is 98.6°F, 45%.", language) == said


@pytest.mark.parametrize("language", ["de", "DE", "de-DE", "de_AT"])
def test_german_rules_by_primary_subtag(language):
    assert verbalize("Es sind 45 %.", language) == "Es sind fünfundvierzig Prozent."


_PIECES = st.sampled_from(["1", "9", "12", "1999", "98", ",", ".", ":", "-", " ", "°", "C", "F", "€", "$", "£", "¥",
                           "%", "km", "h", "Uhr", "a.m.", "pm", "am", "Oktober", "der", "am ", "z. B.", "Nr.",
                           "Mio.", "Millionen", "Euro", "st", "x", "\n"])


@pytest.mark.parametrize("language", ["en", "de"])
@given(text=st.text(max_size=200) | st.lists(_PIECES, max_size=30).map("".join))
def test_verbalize_never_raises_in_any_language(language, text):
    out = verbalize(text, language)
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
