"""The reply in the user's language: the instruction a turn's user message carries.

ASR detects each turn's language (``transcript.final.language``), or ``session.start.language``
fixes it; the LLM is told to answer in it. The instruction goes at the *end of the turn's
user message*, not into the system prompt: the system prompt, the examples and the earlier
turns stay one unchanged token prefix (the prefix cache, :mod:`pipeline.llm.runner.block_cache`,
finds them), and a language switch mid-conversation changes only the new turn. The message
is kept in the history as sent, instruction included, so the next turn's prompt extends this
one's prompt + reply exactly. English turns (and turns of unknown language) carry nothing —
their prompts are as before — except the first English turn after one in another language,
which says "(Answer in English.)": without it the earlier German turns keep the model in
German.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

LANGUAGE_NAMES: dict[str, str] = {
    "en": "English", "zh": "Chinese", "de": "German", "es": "Spanish", "ru": "Russian", "ko": "Korean",
    "fr": "French", "ja": "Japanese", "pt": "Portuguese", "tr": "Turkish", "pl": "Polish", "ca": "Catalan",
    "nl": "Dutch", "ar": "Arabic", "sv": "Swedish", "it": "Italian", "id": "Indonesian", "hi": "Hindi",
    "fi": "Finnish", "vi": "Vietnamese", "he": "Hebrew", "uk": "Ukrainian", "el": "Greek", "ms": "Malay",
    "cs": "Czech", "ro": "Romanian", "da": "Danish", "hu": "Hungarian", "ta": "Tamil", "no": "Norwegian",
    "th": "Thai", "ur": "Urdu", "hr": "Croatian", "bg": "Bulgarian", "lt": "Lithuanian", "la": "Latin",
    "mi": "Maori", "ml": "Malayalam", "cy": "Welsh", "sk": "Slovak", "te": "Telugu", "fa": "Persian",
    "lv": "Latvian", "bn": "Bengali", "sr": "Serbian", "az": "Azerbaijani", "sl": "Slovenian", "kn": "Kannada",
    "et": "Estonian", "mk": "Macedonian", "br": "Breton", "eu": "Basque", "is": "Icelandic", "hy": "Armenian",
    "ne": "Nepali", "mn": "Mongolian", "bs": "Bosnian", "kk": "Kazakh", "sq": "Albanian", "sw": "Swahili",
    "gl": "Galician", "mr": "Marathi", "pa": "Punjabi", "si": "Sinhala", "km": "Khmer", "sn": "Shona",
    "yo": "Yoruba", "so": "Somali", "af": "Afrikaans", "oc": "Occitan", "ka": "Georgian", "be": "Belarusian",
    "tg": "Tajik", "sd": "Sindhi", "gu": "Gujarati", "am": "Amharic", "yi": "Yiddish", "lo": "Lao", "uz": "Uzbek",
    "fo": "Faroese", "ht": "Haitian Creole", "ps": "Pashto", "tk": "Turkmen", "nn": "Nynorsk", "mt": "Maltese",
    "sa": "Sanskrit", "lb": "Luxembourgish", "my": "Myanmar", "bo": "Tibetan", "tl": "Tagalog", "mg": "Malagasy",
    "as": "Assamese", "tt": "Tatar", "haw": "Hawaiian", "ln": "Lingala", "ha": "Hausa", "ba": "Bashkir",
    "jw": "Javanese", "su": "Sundanese", "yue": "Cantonese",
}
"""English names of Whisper's language codes (ISO 639-1, plus ``haw``, ``jw``, ``yue``):
openai/whisper ``whisper/tokenizer.py`` ``LANGUAGES`` (MIT), as transformers ships it
(``transformers.models.whisper.tokenization_whisper.LANGUAGES``), title-cased."""


def language_name(code: str) -> str:
    """The English name of ISO code ``code`` (``"de"`` → ``"German"``); a code not in
    :data:`LANGUAGE_NAMES` is returned as it is."""
    return LANGUAGE_NAMES.get(code.lower(), code)


_NOTE = re.compile(r"\n\(Answer in ([^()\n]+)\.\)\Z")
"""The instruction at the end of a user message as :func:`with_instruction` puts it."""


def reply_instruction(language: str | None, earlier: Iterable[str] = ()) -> str:
    """What a turn in ``language`` (ISO code) tells the model: ``"Answer in German."``; ""
    for an unknown language (None, ""), and for English unless the latest of the ``earlier``
    user messages that carried an instruction asked for another language (then
    ``"Answer in English."``: the conversation switched back)."""
    if not language:
        return ""
    name = language_name(language)
    if language.lower() == "en":
        last = next((m.group(1) for text in reversed(list(earlier)) if (m := _NOTE.search(text))), None)
        if last is None or last == name:
            return ""
    return f"Answer in {name}."


def with_instruction(user_text: str, language: str | None, earlier: Iterable[str] = ()) -> str:
    """``user_text`` with :func:`reply_instruction` appended in parentheses on a new line
    (``"Wie spät ist es?\n(Answer in German.)"``); ``user_text`` itself when there is none.
    ``earlier``: the conversation's earlier user messages, as sent, oldest first."""
    note = reply_instruction(language, earlier)
    return f"{user_text}\n({note})" if note else user_text
