"""Chat history kept under a token budget (sliding window; the system prompt stays)."""

from __future__ import annotations

from typing import Callable


class ChatHistory:
    """The conversation of one session.

    Args:
        system_prompt: always the first message.

    Turns are stored as (user, assistant) pairs; :meth:`prompt` drops the oldest pairs
    until the prompt fits the budget (tokens counted by the caller's tokenizer).
    """

    def __init__(self, system_prompt: str) -> None:
        self.system_prompt = system_prompt
        self.turns: list[tuple[str, str]] = []

    def add_turn(self, user: str, assistant: str) -> None:
        """Record a finished (or interrupted: only what was spoken) exchange."""
        self.turns.append((user, assistant))

    def messages(self, user_text: str, turns: list[tuple[str, str]] | None = None) -> list[dict]:
        """Chat messages: system, past turns, then ``user_text``."""
        msgs = [{"role": "system", "content": self.system_prompt}]
        for u, a in self.turns if turns is None else turns:
            msgs.append({"role": "user", "content": u})
            if a:
                msgs.append({"role": "assistant", "content": a})
        msgs.append({"role": "user", "content": user_text})
        return msgs

    def prompt(self, user_text: str, count_tokens: Callable[[list[dict]], int], budget: int) -> list[dict]:
        """Messages for the next request, oldest turns dropped to fit ``budget`` tokens.

        Dropped turns are forgotten for good, so each request costs one count per drop.
        The system prompt and ``user_text`` are always kept, even over budget.
        """
        while self.turns and count_tokens(self.messages(user_text)) > budget:
            self.turns.pop(0)
        return self.messages(user_text)
