"""German rules for :func:`pipeline.tts.normalize.verbalize` (``language="de"``).

Every number word comes from ``num2words(..., lang="de")`` (cardinals, ordinals, its
German year form); these rules only choose which form to use and add the German words
for symbols, in the style of the semiotic classes of Sproat et al., "Normalization of
non-standard words" (Computer Speech & Language, 2001), with the conventions of DIN 5008
(decimal comma, thousands dot, ``9:30 Uhr``, the ordinal dot, the currency after the
amount):

- **Numbers.** ``98,6`` is 98.6 (decimals digit by digit after "Komma": ``3,14`` → "drei
  Komma eins vier"); a comma is always the decimal comma (an English ``1,000`` is "eins
  Komma null null null"); a dot followed by exactly three digits groups thousands
  (``1.234.567``, ``1.234,5``). A number written English-style, ``3.14`` (a dot before
  1–2 or 4+ digits), is read as a decimal with "Komma", as a German listener expects; so
  ``3.141`` is 3141. ``1.2.3`` and dates like ``3.10.2024`` are left alone. Four plain
  digits 1100–2099 are read as a year (``1999`` → "neunzehnhundertneunundneunzig",
  ``2024`` → "zweitausendvierundzwanzig", num2words' ``to="year"``); a leading minus is
  "minus". Before a word that counts (a unit, a currency, "Grad", "Prozent", "Uhr") a
  number ending in 1 ends in "ein"/"eine" (``1 km`` → "ein Kilometer", ``1 h`` → "eine
  Stunde") and exactly 1 takes the singular; German unit words are mostly the same in
  the plural. A bare ``1`` stays "eins" (the noun after it is not known).
- **Abbreviations** (``z. B.``/``z.B.``, ``d. h.``, ``usw.``, ``ca.``, ``bzw.``, ``Dr.``,
  ``Nr.`` before a digit, ``Mio.``, ``Mrd.``, …) become their words.
- **Temperatures** ``98,6 °F`` → "… Grad Fahrenheit", ``21 °C`` → "… Grad Celsius".
- **Money**: the symbol or code before or after the amount (``19,99 €``, ``€ 5``,
  ``5 EUR``, ``19,99 Euro``; ``$`` Dollar, ``£`` Pfund, ``¥`` Yen, ``CHF`` Franken):
  ``19,99 €`` → "neunzehn Euro neunundneunzig", ``0,50 €`` → "fünfzig Cent",
  ``2,5 Mio. €`` → "zwei Komma fünf Millionen Euro".
- **Percent** ``45 %`` → "fünfundvierzig Prozent"; **units** with German words
  (``km/h`` → "Kilometer pro Stunde", ``kg`` → "Kilogramm", ``m`` → "Meter", …).
- **Times**: ``9:30``/``9:30 Uhr``/``9.30 Uhr`` → "neun Uhr dreißig", ``9 Uhr`` → "neun
  Uhr", ``9:05`` → "neun Uhr fünf". An English ``a.m.``/``p.m.`` (``9 a.m.``, ``9:30 pm``,
  ``9am``; not ``5 am``, the German word) is turned into the 24-hour clock German uses:
  ``9 a.m.`` → "neun Uhr", ``9 p.m.`` → "einundzwanzig Uhr", ``12 a.m.`` → "null Uhr".
- **Ordinals** (a number with a dot) only where they are unambiguous, so that "Die
  Antwort ist 42. Möchtest du …" keeps its cardinal: after an article or a contraction
  — "der/die/das" give num2words' form ``der 3. Platz`` → "der dritte Platz";
  "dem/den/des/am/im/vom/zum/zur/beim" give "-en", ``am 3. Oktober`` → "am dritten
  Oktober" — or before a month without an article, read as a date in the nominative
  masculine (der Tag): ``3. Oktober`` → "dritter Oktober". ``der 3.`` at the end keeps
  the dot as the sentence's end. Other forms (the dative after "der", "ein …") are not
  guessed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from num2words import num2words

_NUM = r"[1-9]\d{0,2}(?:\.\d{3})+(?:,\d+)?|0\.\d+(?!\d)|\d+\.(?:\d{1,2}|\d{4,})(?!\d)|\d+(?:,\d+)?"
"""A number: thousands grouped by dots (an optional decimal comma; a group never starts with
0), an English-style decimal point (after a lone 0, or not before exactly three digits), or
digits with an optional decimal comma."""

ABBREVIATIONS = {
    "z. B.": "zum Beispiel", "d. h.": "das heißt", "u. a.": "unter anderem", "z. T.": "zum Teil",
    "usw.": "und so weiter", "bzw.": "beziehungsweise", "ca.": "circa", "evtl.": "eventuell",
    "ggf.": "gegebenenfalls", "inkl.": "inklusive", "vgl.": "vergleiche", "Dr.": "Doktor",
    "Prof.": "Professor", "Nr.": "Nummer", "Mio.": "Millionen", "Mrd.": "Milliarden",
}
"""Abbreviations spoken as words (case-sensitive; ``"z. B."`` also matches ``z.B.``).
``Nr.`` only before a digit."""

UNITS = {
    "km/h": ("Kilometer pro Stunde", "Kilometer pro Stunde", False),
    "kph": ("Kilometer pro Stunde", "Kilometer pro Stunde", False),
    "mph": ("Meile pro Stunde", "Meilen pro Stunde", True), "m/s": ("Meter pro Sekunde", "Meter pro Sekunde", False),
    "km": ("Kilometer", "Kilometer", False), "cm": ("Zentimeter", "Zentimeter", False),
    "mm": ("Millimeter", "Millimeter", False), "m": ("Meter", "Meter", False), "mi": ("Meile", "Meilen", True),
    "ft": ("Fuß", "Fuß", False), "kg": ("Kilogramm", "Kilogramm", False), "mg": ("Milligramm", "Milligramm", False),
    "g": ("Gramm", "Gramm", False), "t": ("Tonne", "Tonnen", True), "lb": ("Pfund", "Pfund", False),
    "lbs": ("Pfund", "Pfund", False), "oz": ("Unze", "Unzen", True), "ml": ("Milliliter", "Milliliter", False),
    "mL": ("Milliliter", "Milliliter", False), "l": ("Liter", "Liter", False), "L": ("Liter", "Liter", False),
    "kWh": ("Kilowattstunde", "Kilowattstunden", True), "kW": ("Kilowatt", "Kilowatt", False),
    "W": ("Watt", "Watt", False), "V": ("Volt", "Volt", False), "GHz": ("Gigahertz", "Gigahertz", False),
    "MHz": ("Megahertz", "Megahertz", False), "Hz": ("Hertz", "Hertz", False), "TB": ("Terabyte", "Terabyte", False),
    "GB": ("Gigabyte", "Gigabyte", False), "MB": ("Megabyte", "Megabyte", False),
    "KB": ("Kilobyte", "Kilobyte", False), "kB": ("Kilobyte", "Kilobyte", False),
    "ms": ("Millisekunde", "Millisekunden", True), "h": ("Stunde", "Stunden", True),
    "min": ("Minute", "Minuten", True), "s": ("Sekunde", "Sekunden", True), "sec": ("Sekunde", "Sekunden", True),
}
"""Unit symbols after a number → (singular, plural, feminine: "eine" for 1)."""

CURRENCIES = {
    "€": ("Euro", "Cent", "Cent"), "EUR": ("Euro", "Cent", "Cent"), "Euro": ("Euro", "Cent", "Cent"),
    "$": ("Dollar", "Cent", "Cent"), "USD": ("Dollar", "Cent", "Cent"), "Dollar": ("Dollar", "Cent", "Cent"),
    "£": ("Pfund", "Penny", "Pence"), "GBP": ("Pfund", "Penny", "Pence"),
    "CHF": ("Franken", "Rappen", "Rappen"), "Franken": ("Franken", "Rappen", "Rappen"), "¥": ("Yen", "", ""),
}
"""Currency symbols, codes and words → (unit, subunit, subunits); the units are the same
in the plural and all masculine or neuter ("ein Euro", "ein Pfund")."""

SCALES = {"Million": ("Million", "Millionen"), "Millionen": ("Million", "Millionen"),
          "Milliarde": ("Milliarde", "Milliarden"), "Milliarden": ("Milliarde", "Milliarden"),
          "Billion": ("Billion", "Billionen"), "Billionen": ("Billion", "Billionen")}
"""Scale words after an amount of money → (singular, plural); all feminine."""

MONTHS = ("Januar", "Jänner", "Februar", "März", "April", "Mai", "Juni", "Juli", "August", "September",
          "Oktober", "November", "Dezember")
ARTICLES = {"der": "e", "die": "e", "das": "e", "dem": "en", "den": "en", "des": "en", "am": "en", "im": "en",
            "vom": "en", "zum": "en", "zur": "en", "beim": "en"}
"""Words before an ordinal → the ending after num2words' stem ("dritt" + "e"/"en")."""


def _alternatives(words: Iterable[str]) -> str:
    return "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))


_SYMBOLS_BEFORE = _alternatives(c for c in CURRENCIES if not c.istitle())  # "€ 5", "EUR 5"; not "Euro 5"
_SCALE = rf"(?:\s({_alternatives(SCALES)})\b)?"
_ABBREV = re.compile(r"(?<![\w.])(?:" + "|".join(
    re.escape(a).replace(r"\.\ ", r"\.\s?") + (r"(?=\s*\d)" if a == "Nr." else "")
    for a in sorted(ABBREVIATIONS, key=len, reverse=True)) + ")")
_ABBREV_WORDS = {a.replace(" ", ""): w for a, w in ABBREVIATIONS.items()}
_TEMP = re.compile(rf"(?<![\w.,])(-?)({_NUM})\s?°(?:\s?([CF])(?![A-Za-z]))?(?=([A-Za-z])?)")
_MONEY_BEFORE = re.compile(rf"(-?)({_SYMBOLS_BEFORE})\s?({_NUM}){_SCALE}(?!\w)")
_MONEY_AFTER = re.compile(rf"(?<![\w.,])(-?)({_NUM}){_SCALE}\s?({_alternatives(CURRENCIES)})(?!\w)")
_PERCENT = re.compile(rf"(?<![\w.,])(-?)({_NUM})\s?%")
_UNIT = re.compile(rf"(?<![\w.,])(-?)({_NUM})\s?({_alternatives(UNITS)})(?![\w/])")
_TIME = re.compile(r"(?<![\w.,:])([01]?\d|2[0-3])(?!\d)(?::([0-5]\d)(?![\d:])|\.([0-5]\d)(?=\s?Uhr\b))?"
                   r"(\s?Uhr\b|\s?[aApP]\.[mM]\.?|\s?(?:AM|PM|pm)\b|am\b)?")
_ORDINAL = re.compile(rf"(?<![\w.,])(?:({_alternatives(ARTICLES)}|{_alternatives(a.capitalize() for a in ARTICLES)})"
                      rf"\s+)?(\d{{1,4}})\.(?!\d)(?=(\s*(?:{_alternatives(MONTHS)})\b)?)(?=(\s*$)?)")
_NUMBER = re.compile(rf"(?<![\w.,\-])(-?)({_NUM})(?![\w]|[.,\-]\d)(?=(\s(?:Million|Milliarde|Billion)\b)?)")


def _split(text: str) -> tuple[str, str]:
    """``text`` (see ``_NUM``) as its whole digits and its decimal digits ("" if none)."""
    if "," in text:
        whole, frac = text.split(",", 1)
        return whole.replace(".", ""), frac
    if re.fullmatch(r"[1-9]\d{0,2}(?:\.\d{3})+", text):
        return text.replace(".", ""), ""
    whole, _, frac = text.partition(".")
    return whole, frac


def _cardinal(n: int, *, counting: str = "") -> str:
    """``n`` in words; before a masculine/neuter noun (``counting="m"``) a final "eins" is
    "ein", before a feminine one (``"f"``) "eine"."""
    words = num2words(n, lang="de")
    if counting and words.endswith("eins"):
        words = words[:-1] + ("e" if counting == "f" else "")
    return words


def _number(text: str, *, year_ok: bool = False, counting: str = "") -> str:
    whole, frac = _split(text)
    if year_ok and whole == text and len(whole) == 4 and 1100 <= int(whole) <= 2099:
        return num2words(int(whole), lang="de", to="year")
    if frac:
        digits = " ".join(num2words(int(d), lang="de") for d in frac)
        return f"{num2words(int(whole or '0'), lang='de')} Komma {digits}"
    return _cardinal(int(whole), counting=counting)


def _signed(sign: str, words: str) -> str:
    return f"minus {words}" if sign else words


def _is_one(text: str) -> bool:
    whole, frac = _split(text)
    return int(whole) == 1 and not frac.strip("0")


def _temperature(m: re.Match) -> str:
    scale = {"C": " Celsius", "F": " Fahrenheit"}.get(m.group(3) or "", "")
    glue = " " if m.group(4) else ""
    return f"{_signed(m.group(1), _number(m.group(2), counting='m'))} Grad{scale}{glue}"


def _money(sign: str, sym: str, amount: str, scale: str | None) -> str:
    unit, sub_one, sub_many = CURRENCIES[sym]
    if scale:
        one, many = SCALES[scale]
        return f"{_signed(sign, _number(amount, counting='f'))} {one if _is_one(amount) else many} {unit}"
    whole, frac = _split(amount)
    if frac and not sub_one:
        return f"{_signed(sign, _number(amount))} {unit}"
    cents = int(frac[:2].ljust(2, "0")) if frac else 0
    if not cents:
        return _signed(sign, f"{_cardinal(int(whole), counting='m')} {unit}")
    if not int(whole):
        return _signed(sign, f"{_cardinal(cents, counting='m')} {sub_one if cents == 1 else sub_many}")
    return _signed(sign, f"{_cardinal(int(whole), counting='m')} {unit} {_cardinal(cents)}")


def _percent(m: re.Match) -> str:
    return f"{_signed(m.group(1), _number(m.group(2), counting='n'))} Prozent"


def _unit(m: re.Match) -> str:
    one, many, feminine = UNITS[m.group(3)]
    words = _number(m.group(2), counting="f" if feminine else "m")
    return f"{_signed(m.group(1), words)} {one if _is_one(m.group(2)) else many}"


def _time(m: re.Match) -> str:
    hour, colon_min, dot_min, suffix = m.groups()
    minute = colon_min or dot_min
    suffix = (suffix or "").strip()
    if not minute and not suffix:
        return m.group(0)  # a bare number: not a time
    h = int(hour)
    if suffix and suffix != "Uhr":
        if not 1 <= h <= 12:
            return m.group(0)
        h = h % 12 + (12 if suffix[0] in "pP" else 0)
    words = f"{_cardinal(h, counting='m')} Uhr"  # "ein Uhr"
    return f"{words} {num2words(int(minute), lang='de')}" if minute and int(minute) else words


def _ordinal(m: re.Match) -> str:
    article, digits, month, ends = m.groups()
    if not article and not month:
        return m.group(0)  # "42. Möchtest du …": a cardinal at a sentence's end
    stem = num2words(int(digits), lang="de", to="ordinal").removesuffix("e")
    ending = ARTICLES[article.lower()] if article else "er"
    words = f"{stem}{ending}" + ("." if ends is not None else "")  # "der 3." at the end: the dot ends it too
    return f"{article} {words}" if article else words


def _plain(m: re.Match) -> str:
    counting = "f" if m.group(3) else ""  # "eine Million"
    return _signed(m.group(1), _number(m.group(2), year_ok=not counting, counting=counting))


RULES: tuple[tuple[re.Pattern, Callable[[re.Match], str]], ...] = (
    (_ABBREV, lambda m: _ABBREV_WORDS[re.sub(r"\s", "", m.group(0))]), (_TEMP, _temperature),
    (_MONEY_BEFORE, lambda m: _money(m.group(1), m.group(2), m.group(3), m.group(4))),
    (_MONEY_AFTER, lambda m: _money(m.group(1), m.group(4), m.group(2), m.group(3))),
    (_PERCENT, _percent), (_UNIT, _unit), (_TIME, _time), (_ORDINAL, _ordinal), (_NUMBER, _plain),
)
"""The German rules, in order; :func:`pipeline.tts.normalize.verbalize` applies them."""
