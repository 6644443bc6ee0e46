"""Chat history kept under a token budget (sliding window; the system prompt and the example
exchanges stay)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Counter = Callable[[list[dict]], int]
Exchange = tuple[str, str]
"""One (user, assistant) exchange."""


class ChatHistory:
    """The conversation of one session.

    Args:
        system_prompt: always the first message.
        examples: example (user, assistant) exchanges placed right after the system prompt,
            before the conversation (few-shot framing, :data:`pipeline.config.LlmConfig.examples`);
            they stay like the system prompt, and are left out only of a request whose system
            prompt and user text alone are over the budget.
        slide_to: when the prompt outgrows the budget, the oldest turns are dropped until it
            fits in this fraction of it (0.75), not just under it.

    Turns are stored as (user, assistant) pairs; an empty assistant side is a user turn
    that got no reply — a backchannel spoken over a reply, a spoken turn refused with
    ``busy`` (:meth:`add_unanswered`) — and is rendered as that user message alone: the
    next user message follows it directly (two user messages in a row; the chat templates
    voxpipe ships, ChatML's, render them as they are), so the model sees the words in the
    order they were said and a "what did I just say?" finds them. :meth:`prompt` drops the oldest pairs
    when the prompt is over the budget (tokens counted by the caller's tokenizer), and
    truncates the system prompt and the new user text when they alone do not fit.

    Why ``slide_to``: the LLM's prefix cache reuses a conversation's KV only up to the first
    token that differs from the previous turn's prompt, and dropping the oldest turn changes
    the prompt right after the system prompt: that turn prefills the whole history again.
    Dropping one turn whenever the budget is reached would do that on *every* turn of a long
    conversation; sliding a quarter of the budget at once does it once every few turns (the
    cut stays on turn boundaries, and the turns after a cut extend the same prefix). The price:
    on average about an eighth of the budget less history is kept.
    """

    def __init__(self, system_prompt: str, *, examples: Sequence[Exchange] = (), slide_to: float = 0.75) -> None:
        if not 0.0 < slide_to <= 1.0:
            raise ValueError("slide_to must be in (0, 1]")
        self.system_prompt = system_prompt
        self.examples = tuple(examples)
        self.slide_to = slide_to
        self.turns: list[tuple[str, str]] = []

    @property
    def chars(self) -> int:
        """Characters of the kept turns (both sides): the history's size without tokenizing."""
        return sum(len(u) + len(a) for u, a in self.turns)

    def add_turn(self, user: str, assistant: str) -> None:
        """Record a finished (or interrupted: only what was spoken) exchange."""
        self.turns.append((user, assistant))

    def add_unanswered(self, user: str) -> Exchange:
        """Record a user turn that got no reply (refused with ``busy``); returns its entry,
        for :meth:`forget`."""
        entry = (user, "")
        self.turns.append(entry)
        return entry

    def revise(self, entry: Exchange, user: str) -> Exchange:
        """Replace the user words of ``entry`` (from :meth:`add_unanswered`), in its place,
        with ``user`` (the turn's final transcript came); returns the new entry (``entry``
        itself when it is no longer kept)."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i] is entry:
                self.turns[i] = new = (user, entry[1])
                return new
        return entry

    def forget(self, entry: Exchange) -> None:
        """Drop ``entry`` (from :meth:`add_unanswered`; that very entry, not an equal one),
        if it is still kept: the speech went on, and the turn will be recorded whole."""
        for i in range(len(self.turns) - 1, -1, -1):
            if self.turns[i] is entry:
                del self.turns[i]
                return

    def messages(self, user_text: str, turns: list[tuple[str, str]] | None = None, *,
                 system: str | None = None, examples: bool = True, demos: Sequence[Exchange] = ()) -> list[dict]:
        """Chat messages: system, the example exchanges and ``demos`` (this request's extra
        examples, e.g. a worked tool call; none unless ``examples``), past turns, then
        ``user_text``."""
        msgs = [{"role": "system", "content": self.system_prompt if system is None else system}]
        shown = (*self.examples, *demos) if examples else ()
        for u, a in (*shown, *(self.turns if turns is None else turns)):
            if not u and not a:  # an unanswered turn whose words are not known yet
                continue
            msgs.append({"role": "user", "content": u})
            if a:
                msgs.append({"role": "assistant", "content": a})
        msgs.append({"role": "user", "content": user_text})
        return msgs

    def prompt(self, user_text: str, count_tokens: Counter, budget: int, *,
               demos: Sequence[Exchange] = ()) -> list[dict]:
        """Messages for the next request that never count more than ``budget`` tokens
        (``demos``: extra example exchanges for this request, kept and dropped with the
        examples).

        1. If the prompt is over ``budget``, the oldest turns are dropped until it fits
           in ``slide_to`` × ``budget`` (see the class docstring); dropped turns are
           forgotten for good, so each request costs one count per drop.
        2. If the system prompt, the examples and ``user_text`` alone are over budget, the
           examples are left out and the system prompt and ``user_text`` are cut
           for this request only: a system prompt keeps its *beginning* (the
           instructions) and may use up to half the budget, or more when the user text
           is short; the user text keeps its *end* (the most recent words, which a
           voice turn's reply should answer), starting at a word boundary when there is
           one. ``count_tokens`` is then called O(log len) times (bisection on characters).
        """
        if self.turns and count_tokens(self.messages(user_text, demos=demos)) > budget:
            target = int(budget * self.slide_to)
            while self.turns and count_tokens(self.messages(user_text, demos=demos)) > target:
                self.turns.pop(0)
        msgs = self.messages(user_text, demos=demos)
        if count_tokens(msgs) <= budget:
            return msgs
        system = self.system_prompt

        def alone(user: str, sys: str) -> list[dict]:  # no turns, no examples
            return self.messages(user, [], system=sys, examples=False)

        bare = count_tokens(alone("", ""))  # template overhead
        user_cost = count_tokens(alone(user_text, "")) - bare
        sys_limit = max(budget - user_cost, budget // 2)
        if count_tokens(alone("", system)) > sys_limit:
            fits = lambda k: count_tokens(alone("", system[:k])) <= sys_limit  # noqa: E731
            system = system[: _longest(len(system), fits)]
        fits = lambda k: count_tokens(alone(user_text[len(user_text) - k :], system)) <= budget  # noqa: E731
        tail = user_text[len(user_text) - _longest(len(user_text), fits) :]
        if tail == user_text:
            return alone(tail, system)
        msgs = alone(_word_start(tail), system)
        return msgs if count_tokens(msgs) <= budget else alone(tail, system)


def _longest(n: int, fits: Callable[[int], bool]) -> int:
    """Largest k in [0, n] with ``fits(k)``, assuming ``fits(0)`` (bisection)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _word_start(tail: str, window: int = 32) -> str:
    """Drop a leading partial word when a space is near (CJK text has none)."""
    cut = tail.find(" ", 0, window)
    return tail[cut + 1 :].lstrip() if cut >= 0 else tail
