"""Tool calls in voxpipe's Chat Completions answers: the reply's text read for calls
(:class:`~pipeline.tools.reply.ToolReplyReader`), each good call returned as OpenAI's
``tool_calls`` item — whole in one delta when streaming, which the ``openai`` client's
accumulation takes as it takes split ones — and ``finish_reason: "tool_calls"``.

A block that is not a good call (not JSON, an unknown function, arguments its schema
rejects) is returned as the text the model wrote, as vLLM's tool parsers do: the client sees
what happened; it is not repaired here (a voice turn repairs: :mod:`pipeline.session.tool_turn`).
"""

from __future__ import annotations

from typing import Any

from pipeline.tools.parse import CLOSE, OPEN
from pipeline.tools.reply import ToolReplyReader
from pipeline.tools.types import Text, ToolCall, ToolCallError, ToolSpec


class CompletionReader:
    """A completion's deltas → content text and tool calls.

    Args:
        specs: the tools offered (empty, or ``tool_choice`` ``none``: the text passes as it is).
    """

    def __init__(self, specs: tuple[ToolSpec, ...]) -> None:
        self._reader = ToolReplyReader(specs) if specs else None
        self.calls: list[ToolCall] = []

    def feed(self, delta: str) -> list[str | ToolCall]:
        """What ``delta`` completes: content text, or a call."""
        if self._reader is None:
            return [delta]
        return self._out(self._reader.feed(delta))

    def finish(self) -> list[str | ToolCall]:
        """What was held until the end."""
        if self._reader is None:
            return []
        return self._out(self._reader.finish())

    def _out(self, items: list[Text | ToolCall | ToolCallError]) -> list[str | ToolCall]:
        out: list[str | ToolCall] = []
        for item in items:
            if isinstance(item, ToolCall):
                self.calls.append(item)
                out.append(item)
            elif isinstance(item, ToolCallError):  # returned as the model wrote it
                out.append(f"{OPEN}{item.raw}{CLOSE}")
            elif item.text:
                out.append(item.text)
        return out

    @property
    def finish_reason(self) -> str | None:
        """``tool_calls`` when the reply made any; None: the stream's own reason."""
        return "tool_calls" if self.calls else None


def call_delta(index: int, call: ToolCall) -> dict[str, Any]:
    """A streamed chunk's ``delta`` carrying call number ``index`` whole."""
    return {"tool_calls": [{"index": index, **call.to_openai()}]}
