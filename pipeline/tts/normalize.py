"""Say symbols, units and numbers as words before synthesis, per language.

The LLM writes ``98.6°F``, ``45%``, ``$19.99``, ``5 km``, ``21st``, ``Dr.``; a voice reads
what its front end knows: Piper's espeak-ng reads digits but drops ``°`` (after
:func:`~pipeline.tts.chunker.speakable` removed the symbol: "98.6 F"), and a Coqui model
trained on characters reads no digits at all. :func:`verbalize` rewrites such text into
words — numbers through ``num2words`` (a well-kept library: cardinals, ordinals, years),
the rest by the rules below, in the style of the text-normalisation front ends of TTS
systems (e.g. the "semiotic classes" of Sproat et al., "Normalization of non-standard
words", Computer Speech & Language 2001: measures, money, ordinals, abbreviations).
Only what is sent to the voice changes; the reply's text (``response.text``) is kept.

``verbalize(text, language)`` takes an ISO 639-1 code: ``"de"`` (or ``"de-DE"``, ``"de_AT"``:
the primary subtag counts) uses the German rules of :mod:`pipeline.tts.normalize_de`; ``"en"``,
``None`` and any code without rules of its own use the English rules below.

English rules, in order: abbreviations (``Dr.`` → Doctor, ``e.g.`` → for example, …),
temperatures (``°F``/``°C``/``°``), money (``$ € £ ¥`` before the amount with an optional
million/billion/thousand, or after it: ``19,99 €``), percentages, numbers with a unit
(``km``, ``kg``, ``mph``, ``km/h``, ``GB``, …; singular for exactly 1), times (``9:30``,
``9:05``, ``9:00`` with an optional am/pm), ordinals (``21st``), then any other number
(thousands separators dropped; four-digit 1100–2099 read as a year; decimals digit by
digit after "point"; a leading minus as "minus"). Before a symbol (``°``, a currency,
``%``, a unit) a comma followed by one or two digits is a decimal comma, as written in
much of Europe: ``98,6 °F`` → "ninety-eight point six degrees Fahrenheit", ``19,99 €`` →
"nineteen euros and ninety-nine cents"; elsewhere a comma groups thousands. Version
strings and the like (``1.2.3``, ``v2``, ``mp3``) are left alone.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from num2words import num2words

from pipeline.tts import normalize_de as german

_NUM = r"[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?|0,\d+(?![\d,])|\d+(?:\.\d+)?"
"""A number: thousands separated by commas (a group never starts with 0), a decimal comma after
a lone 0 (``0,125``), or plain digits; an optional decimal part."""
_MEASURE = rf"\d+,\d{{1,2}}(?!\d|,\d)|{_NUM}"
"""A number before a symbol: also with a decimal comma (``98,6 °F``, ``19,99 €``)."""

ABBREVIATIONS = {
    "Dr.": "Doctor", "Mr.": "Mister", "Mrs.": "Missus", "Ms.": "Miz", "Prof.": "Professor", "Jr.": "Junior",
    "Sr.": "Senior", "e.g.": "for example", "i.e.": "that is", "etc.": "et cetera", "vs.": "versus",
    "approx.": "approximately", "a.m.": "A M", "p.m.": "P M", "No.": "number",
}
"""Abbreviations spoken as words (case-sensitive, with their dots). ``No.`` only before a
digit; ``St.`` is left alone (Saint or Street)."""

UNITS = {
    "km/h": ("kilometer per hour", "kilometers per hour"), "kph": ("kilometer per hour", "kilometers per hour"),
    "mph": ("mile per hour", "miles per hour"), "m/s": ("meter per second", "meters per second"),
    "km": ("kilometer", "kilometers"), "cm": ("centimeter", "centimeters"), "mm": ("millimeter", "millimeters"),
    "m": ("meter", "meters"), "mi": ("mile", "miles"), "ft": ("foot", "feet"),
    "kg": ("kilogram", "kilograms"), "mg": ("milligram", "milligrams"), "g": ("gram", "grams"),
    "lb": ("pound", "pounds"), "lbs": ("pounds", "pounds"), "oz": ("ounce", "ounces"),
    "ml": ("milliliter", "milliliters"), "mL": ("milliliter", "milliliters"), "L": ("liter", "liters"),
    "kWh": ("kilowatt hour", "kilowatt hours"), "kW": ("kilowatt", "kilowatts"), "W": ("watt", "watts"),
    "V": ("volt", "volts"), "GHz": ("gigahertz", "gigahertz"), "MHz": ("megahertz", "megahertz"),
    "Hz": ("hertz", "hertz"), "TB": ("terabyte", "terabytes"), "GB": ("gigabyte", "gigabytes"),
    "MB": ("megabyte", "megabytes"), "KB": ("kilobyte", "kilobytes"), "kB": ("kilobyte", "kilobytes"),
    "ms": ("millisecond", "milliseconds"), "hr": ("hour", "hours"), "hrs": ("hours", "hours"),
    "h": ("hour", "hours"), "min": ("minute", "minutes"), "sec": ("second", "seconds"),
}
"""Unit symbols after a number → (singular, plural) words."""

CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
              "£": ("pound", "pounds", "penny", "pence"), "¥": ("yen", "yen", "", "")}
"""Currency symbols → (unit, units, subunit, subunits)."""

_SCALE = r"(?:\s?(thousand|million|billion|trillion|k|bn|M)\b)?"
_SCALES = {"k": "thousand", "bn": "billion", "M": "million"}

_ABBREV = re.compile("|".join(re.escape(a) + (r"(?=\s*\d)" if a == "No." else "")
                              for a in sorted(ABBREVIATIONS, key=len, reverse=True)))
_TEMP = re.compile(rf"(?<![\d,])(-?)({_MEASURE})\s?°(?:\s?([CF])(?![A-Za-z]))?(?=([A-Za-z])?)")
_MONEY = re.compile(rf"(-?)([$€£¥])\s?({_MEASURE}){_SCALE}")
_MONEY_AFTER = re.compile(rf"(?<![\w.,])(-?)({_MEASURE})\s?([$€£¥])")
_PERCENT = re.compile(rf"(?<![\d,])(-?)({_MEASURE})\s?%")
_UNIT = re.compile(rf"(?<![\w.])(-?)({_MEASURE})\s?("
                   + "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True)) + r")(?![\w/])")
_TIME = re.compile(r"\b([01]?\d|2[0-3]):([0-5]\d)(?:\s?([ap])\.?m\.?)?(?![\w:])", re.IGNORECASE)
_ORDINAL = re.compile(r"\b(\d+)(st|nd|rd|th)\b")
_NUMBER = re.compile(rf"(?<![\w.\-])(-?)({_NUM})(?![\w]|[.\-]\d)")


def _plain_digits(text: str) -> str:
    """``text`` (see ``_MEASURE``) with a decimal point and no thousands commas."""
    decimal_comma = re.fullmatch(r"\d+,\d{1,2}|0,\d+", text)
    return text.replace(",", ".") if decimal_comma else text.replace(",", "")


def _number(text: str, *, year_ok: bool = False) -> str:
    """``text`` (digits, commas, one decimal point or comma) in words."""
    plain = _plain_digits(text)
    if year_ok and "," not in text and "." not in plain and len(plain) == 4 and 1100 <= int(plain) <= 2099:
        return num2words(int(plain), to="year")
    if "." in plain:
        whole, frac = plain.split(".", 1)
        return f"{num2words(int(whole or '0'))} point {' '.join(num2words(int(d)) for d in frac)}"
    return num2words(int(plain))


def _signed(sign: str, words: str) -> str:
    return f"minus {words}" if sign else words


def _is_one(text: str) -> bool:
    return _plain_digits(text) in ("1", "1.0")


def _temperature(m: re.Match) -> str:
    scale = {"C": " Celsius", "F": " Fahrenheit"}.get(m.group(3) or "", "")
    unit = "degree" if _is_one(m.group(2)) else "degrees"
    glue = " " if m.group(4) else ""  # "3°Fahrenheit": a word follows at once
    return f"{_signed(m.group(1), _number(m.group(2)))} {unit}{scale}{glue}"


def _money(m: re.Match) -> str:
    return _say_money(*m.groups())


def _money_after(m: re.Match) -> str:
    sign, amount, sym = m.groups()
    return _say_money(sign, sym, amount, None)


def _say_money(sign: str, sym: str, amount: str, scale: str | None) -> str:
    one, many, sub_one, sub_many = CURRENCIES[sym]
    if scale:
        return f"{_signed(sign, _number(amount))} {_SCALES.get(scale, scale)} {many}"
    whole, _, cents = _plain_digits(amount).partition(".")
    parts = []
    if int(whole) or not cents or not sub_one:
        parts.append(f"{num2words(int(whole))} {one if int(whole) == 1 else many}")
    if cents and sub_one and int(cents[:2].ljust(2, "0")):
        c = int(cents[:2].ljust(2, "0"))
        parts.append(f"{num2words(c)} {sub_one if c == 1 else sub_many}")
    return _signed(sign, " and ".join(parts))


def _percent(m: re.Match) -> str:
    return f"{_signed(m.group(1), _number(m.group(2)))} percent"


def _unit(m: re.Match) -> str:
    one, many = UNITS[m.group(3)]
    return f"{_signed(m.group(1), _number(m.group(2)))} {one if _is_one(m.group(2)) else many}"


def _time(m: re.Match) -> str:
    hour, minute, ampm = int(m.group(1)), int(m.group(2)), m.group(3)
    words = num2words(hour)
    if minute == 0:
        words += "" if ampm else " o'clock"
    elif minute < 10:
        words += f" oh {num2words(minute)}"
    else:
        words += f" {num2words(minute)}"
    return f"{words} {ampm.upper()} M" if ampm else words


def _ordinal(m: re.Match) -> str:
    return num2words(int(m.group(1)), to="ordinal")


def _plain(m: re.Match) -> str:
    return _signed(m.group(1), _number(m.group(2), year_ok=True))


_RULES: tuple[tuple[re.Pattern, Callable[[re.Match], str]], ...] = (
    (_ABBREV, lambda m: ABBREVIATIONS[m.group(0)]), (_TEMP, _temperature), (_MONEY, _money),
    (_MONEY_AFTER, _money_after), (_PERCENT, _percent), (_UNIT, _unit), (_TIME, _time), (_ORDINAL, _ordinal),
    (_NUMBER, _plain),
)


MAX_DIGITS = 15
"""Numbers with more digits are left as digits (the voice reads them as it can)."""


def _safe(say: Callable[[re.Match], str]) -> Callable[[re.Match], str]:
    """A rule that keeps the matched text when it cannot say it (a number too long)."""

    def apply(m: re.Match) -> str:
        if sum(ch.isdigit() for ch in m.group(0)) > MAX_DIGITS:
            return m.group(0)
        try:
            return say(m)
        except (ValueError, OverflowError, KeyError, NotImplementedError):
            return m.group(0)

    return apply


LANGUAGES = {"en": _RULES, "de": german.RULES}
"""ISO 639-1 code → its rules; any other code reads as English."""


def verbalize(text: str, language: str | None = "en") -> str:
    """``text`` with abbreviations, temperatures, money, percentages, measures, times,
    ordinals and numbers written out in words of ``language`` (an ISO 639-1 code such as
    ``"en"`` or ``"de"``; ``None`` or a language without rules: English; see the module
    docstring); other text is unchanged. ``"It is 98.6°F."`` → ``"It is ninety-eight point
    six degrees Fahrenheit."``; in German ``"Es sind 98,6 °F."`` → ``"Es sind achtundneunzig
    Komma sechs Grad Fahrenheit."``. Never raises on any string."""
    code = (language or "en").strip().lower().replace("_", "-").split("-")[0]
    for pattern, say in LANGUAGES.get(code, _RULES):
        text = pattern.sub(_safe(say), text)
    return text
