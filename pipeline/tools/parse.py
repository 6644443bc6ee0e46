"""Split a reply's text stream into speech and tool-call blocks, delta by delta.

The format is Hermes' function calling as Qwen2.5 uses it (NousResearch
"Hermes-Function-Calling", README "Prompt format for function calling"; Qwen2.5's chat
template, whose system prompt asks for it): each call is a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>`` lines,
text around the blocks is the reply. In Qwen2.5's vocabulary both tags are single tokens that
are not "special", so the detokenizer keeps them in the text.

Qwen2.5-Coder-0.5B-Instruct (voxpipe's ``qwen``), asked with that very prompt, answered
greedily with the bare JSON object and no tags (measured: ``{"name": "get_weather",
"arguments": {"city": "Paris"}}`` then end of sequence). So by default a reply whose first
character that is not blank is ``{`` is held whole and comes out as one block at
:meth:`ToolCallParser.finish` (a voice reply never starts with a brace; JSON is never spoken).
"""

from __future__ import annotations

import json
import re

from pipeline.tools.types import Event, Text, ToolBlock

FENCE = re.compile(r"```[A-Za-z]*[ \t]*\r?\n\s*(\S)")
"""A code fence's first line and the first character after it."""
MAX_FENCE_HEAD = 64
"""A reply starting with backticks is decided within this many characters."""
OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def held_prefix(text: str) -> int:
    """Length of the longest end of ``text`` that could still grow into :data:`OPEN` or
    :data:`CLOSE` (held back until the next delta says which)."""
    for n in range(min(len(text), len(CLOSE) - 1), 0, -1):
        tail = text[-n:]
        if OPEN.startswith(tail) or CLOSE.startswith(tail):
            return n
    return 0


class ToolCallParser:
    """Incremental: :meth:`feed` each text delta, then :meth:`finish` once.

    Args:
        bare_json: a reply that starts with ``{`` (after blanks), or with a code fence whose
            first line is followed by ``{``, is one bare call block, emitted at
            :meth:`finish` (see the module's note); False: such a reply is text.

    Guarantees: no part of a tag is ever emitted as text, whichever deltas it is split
    across; the text outside blocks comes out exactly (concatenated, whatever its chunking),
    except a stray ``</tool_call>`` outside any block, which is dropped (markup is never
    spoken); inside a block everything up to the first ``</tool_call>`` is the block's raw
    text (a nested ``<tool_call>`` included). Pure: no I/O, no clock.
    """

    def __init__(self, *, bare_json: bool = True) -> None:
        self.bare_json = bare_json
        self._buf = ""
        self._in_block = False
        self._started = False  # a character that is not blank has come (the reply's kind is known)
        self._bare = False  # the reply is a bare JSON call: held whole until finish

    def feed(self, delta: str) -> list[Event]:
        """The events that ``delta`` completes (text ready to speak, whole blocks)."""
        self._buf += delta
        events: list[Event] = []
        if not self._started:
            self._start()
        if not self._started or self._bare:
            return events
        while self._step(events):
            pass
        return events

    def _start(self) -> None:
        """Decide what kind of reply this is once its start shows: text, or a bare call (a
        ``{``, or a code fence whose next line starts with ``{``: Qwen2.5-Coder-0.5B fenced
        its call as ```` ```json ```` on ``/v1/chat/completions``). A fence's first line is
        waited for (a spoken reply never starts with backticks)."""
        head = self._buf.lstrip()
        if not head:
            return
        if self.bare_json and head.startswith("`"):
            fence = FENCE.match(head)
            if fence is None and head.startswith("```"[: len(head)]) and len(head) < MAX_FENCE_HEAD:
                return  # undecided: the fence's first line is not complete yet
            self._started = True
            self._bare = fence is not None and fence.group(1) == "{"
            return
        self._started = True
        self._bare = self.bare_json and head.startswith("{")

    def finish(self) -> list[Event]:
        """End of stream: held text (a tag's start that never finished) as :class:`Text`, or
        an unterminated block as ``ToolBlock(raw, closed=False)``, a bare JSON reply as
        ``ToolBlock(raw)`` — its first JSON value alone when text follows it (Qwen2.5-Coder
        -0.5B went on after ``{"name": "get_time", "arguments": {}}`` with a sentence), the
        rest as :class:`Text`. Resets the parser."""
        buf, in_block, bare = self._buf, self._in_block, self._bare
        self._buf, self._in_block, self._started, self._bare = "", False, False, False
        if bare:
            fence = FENCE.match(buf.lstrip())
            body = buf.lstrip()[fence.start(1):] if fence is not None else buf
            start = len(body) - len(body.lstrip())
            try:
                _, end = json.JSONDecoder().raw_decode(body, start)
            except (ValueError, RecursionError):
                return [ToolBlock(body)]
            rest = body[end:]
            if fence is not None:
                rest = rest.lstrip().removeprefix("```")
            return [ToolBlock(body[:end])] + ([Text(rest)] if rest.strip() else [])
        if in_block:
            return [ToolBlock(buf, closed=False)]
        return [Text(buf)] if buf else []

    def _step(self, events: list[Event]) -> bool:
        """Emit what the buffer settles; True while it may settle more."""
        buf = self._buf
        if self._in_block:
            end = buf.find(CLOSE)
            if end < 0:
                return False
            events.append(ToolBlock(buf[:end]))
            self._buf, self._in_block = buf[end + len(CLOSE):], False
            return True
        opened, closed = buf.find(OPEN), buf.find(CLOSE)
        cut = min(i for i in (opened, closed, len(buf)) if i >= 0)
        if cut == len(buf):
            cut -= held_prefix(buf)
        if cut:
            events.append(Text(buf[:cut]))
        if cut == opened:
            self._buf, self._in_block = buf[cut + len(OPEN):], True
            return True
        if cut == closed:
            self._buf = buf[cut + len(CLOSE):]
            return True
        self._buf = buf[cut:]
        return False
