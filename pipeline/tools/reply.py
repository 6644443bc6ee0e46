"""Read a reply's text stream for tool calls: speech, checked calls and botched ones, delta by
delta. What every consumer of an LLM stream with tools offered uses (a voice turn, the
OpenAI-compatible endpoints, the Realtime edge), so they agree on what a call is."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.tools.parse import ToolCallParser
from pipeline.tools.types import Text, ToolBlock, ToolCall, ToolCallError, ToolCallFault, ToolSpec
from pipeline.tools.validate import validate_call

Item = Text | ToolCall | ToolCallError
"""What :class:`ToolReplyReader` gives: text to speak or show, a call to run, a call to repair."""


class ToolReplyReader:
    """Feed a reply's deltas (:meth:`feed`), then :meth:`finish` once.

    Each closed ``<tool_call>`` block (or a bare JSON reply: :mod:`pipeline.tools.parse`) is
    checked against ``specs`` (:func:`~pipeline.tools.validate.validate_call`): a
    :class:`ToolCall` when it is good, a :class:`ToolCallError` saying what to fix otherwise.
    A block still open when the stream ends is checked too (a model may end its turn right
    after the JSON); if it does not hold a good call, its error says it was cut off. Never
    raises for anything the model writes.

    Args:
        specs: the tools offered with the prompt.
    """

    def __init__(self, specs: Sequence[ToolSpec]) -> None:
        self.specs = tuple(specs)
        self._parser = ToolCallParser()
        self.calls: list[ToolCall] = []
        self.errors: list[ToolCallError] = []
        self.text = ""

    def feed(self, delta: str) -> list[Item]:
        """The items that ``delta`` completes."""
        return [self._item(e) for e in self._parser.feed(delta)]

    def finish(self) -> list[Item]:
        """The items held until the end of the stream."""
        return [self._item(e) for e in self._parser.finish()]

    def _item(self, event: Text | ToolBlock) -> Item:
        if isinstance(event, Text):
            self.text += event.text
            return event
        checked = validate_call(event.raw.strip(), self.specs)
        if isinstance(checked, ToolCallError) and not event.closed:
            checked = ToolCallError(checked.reason, f"the call was cut off before its end ({checked.message})",
                                    checked.raw, checked.name)
        if isinstance(checked, ToolCall):
            self.calls.append(checked)
        else:
            self.errors.append(checked)
        return checked


def repair_note(error: ToolCallError) -> str:
    """What the model is told after a botched call, to write it again (a user turn after its
    own): the fault, in words it can act on, and the format."""
    if error.reason is ToolCallFault.UNKNOWN_TOOL:
        hint = "Call one of the offered tools, or answer in words."
    else:
        hint = 'Write the call again as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, or answer in words.'
    return f"Your tool call was not valid: {error.message}. {hint}"
