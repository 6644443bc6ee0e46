"""Prompt tokens of chat messages for a model that is not loaded here (``--llm openai:URL``):
with the model's own tokenizer and chat template when the user gives its folder
(``--tokenizer PATH``), else a deliberately high estimate.

The session trims its history to the context budget with this count
(:meth:`~pipeline.session.history.ChatHistory.prompt`), so an over-estimate only drops a
little old history early; an under-estimate could overflow the server's context window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pipeline.llm.input import chat_prompt_ids

LETTERS_PER_TOKEN = 2.5
"""Lower-case ASCII letters and whitespace per token of the estimate. OpenAI's rule of thumb
is ~4 characters of common English text per token (help.openai.com, "What are tokens and
how to count them"), but this project's tokenizers (SmolLM2, Qwen2.5) need more tokens for
other languages and repeats: measured worst cases 2.5-3 characters per token (German and
French prose, "ok ok ok"). Upper-case letters count 1 token per 2 (all-caps transcripts
measured 2.5 characters per token), and every digit, ASCII punctuation mark and extra
UTF-8 byte of a non-ASCII character 1 token (both tokenizers split numbers into digits;
code, dates, accented and CJK text measured 1.5-2.1 characters per token). Measured over
the test clips' transcripts (as they are, lower- and sentence-case) and mixed samples
(numbers, code, URLs, Spanish, German, French, Russian, CJK, emoji): the estimate was
1.0-4.0 times the real count of either tokenizer, median 1.7 (English voice chat: ~1.6)."""
MESSAGE_OVERHEAD = 6
"""Tokens a chat template adds per message: ChatML (Qwen, SmolLM2) wraps each one in
``<|im_start|>ROLE\\n`` … ``<|im_end|>\\n`` (5 tokens; SmolLM2 measured 5.5 per message
with the generation prompt); OpenAI's cookbook counts 3-4 for its own models ("How to
count tokens with tiktoken", ``num_tokens_from_messages``)."""
REPLY_PRIMING = 4
"""Tokens of the generation prompt (``<|im_start|>assistant\\n``: 3 in ChatML; the cookbook's
"every reply is primed with <|start|>assistant<|message|>": 3), plus one to spare."""

Counter = Callable[[list[dict]], int]
"""``count(messages) -> prompt tokens``."""


def estimate_tokens(messages: list[dict]) -> int:
    """An upper estimate of the prompt tokens of chat ``messages``: each message's
    :func:`estimate_text` + :data:`MESSAGE_OVERHEAD`, + :data:`REPLY_PRIMING`. A content that
    is not a string counts by its ``str()``."""
    total = REPLY_PRIMING
    for message in messages:
        content = message.get("content") or ""
        total += estimate_text(content if isinstance(content, str) else str(content)) + MESSAGE_OVERHEAD
    return total


def estimate_text(text: str) -> int:
    """Tokens of ``text`` by character class (see :data:`LETTERS_PER_TOKEN` for the rates and
    their measurement): ``ceil(lower-case letters, spaces and non-ASCII characters / 2.5) +
    ceil(upper-case letters / 2) + digits + ASCII punctuation + extra UTF-8 bytes``."""
    upper = other = singles = 0
    for ch in text:
        if "A" <= ch <= "Z":
            upper += 1
        elif ch.isascii() and (ch.isdigit() or not (ch.isalpha() or ch.isspace())):
            singles += 1
        else:
            other += 1
            if not ch.isascii():
                singles += len(ch.encode()) - 1
    return math.ceil(other / LETTERS_PER_TOKEN) + math.ceil(upper / 2) + singles


def template_counter(tokenizer: Any) -> Counter:
    """A counter with a Hugging Face tokenizer's chat template (``apply_chat_template`` with
    the generation prompt): exactly what a server running that model prefills."""

    def count(messages: list[dict]) -> int:
        return len(chat_prompt_ids(tokenizer, messages))

    return count


def load_counter(tokenizer_path: str | None) -> Counter:
    """The counter for ``--tokenizer PATH`` (a local Hugging Face tokenizer folder with a chat
    template), or :func:`estimate_tokens` without one. Loads nothing from the hub.

    Raises:
        FileNotFoundError: ``tokenizer_path`` is not a folder.
        ValueError: the folder holds no tokenizer, or one without a chat template.
    """
    if not tokenizer_path:
        return estimate_tokens
    from pipeline.llm.loader import load_tokenizer

    tok = load_tokenizer(tokenizer_path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"--tokenizer {tokenizer_path}: the tokenizer has no chat template to count a prompt with")
    return template_counter(tok)
