"""A remote server's streamed ``tool_calls`` put back together as call blocks in the text
(``--llm openai:URL``: :class:`~pipeline.llm.remote.OpenAiLlm`), so a remote model's calls
reach every consumer in the one format it reads (:class:`~pipeline.tools.reply.ToolReplyReader`)."""

from __future__ import annotations

import json
from typing import Any

from pipeline.tools.render import call_block


class StreamedCalls:
    """A streamed answer's ``tool_calls`` deltas gathered into calls (OpenAI's streaming
    format: the first delta of a call has its ``index``, id and name, later ones of that
    ``index`` add pieces of ``arguments``). Servers that stray from it are read too: a delta
    without ``index`` starts a call when it has an id other than the latest call's (or none
    has started), else adds to the latest; ``arguments`` sent as an object is taken as its
    JSON."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []  # [name, arguments so far], in the order they started
        self._by_index: dict[int, int] = {}  # the server's index -> place in calls
        self._last_id: str | None = None  # the id of the latest call without an index

    def add(self, deltas: Any) -> None:
        """Take one chunk's ``delta.tool_calls``."""
        for d in deltas:
            index = getattr(d, "index", None)
            if isinstance(index, int):
                at = self._by_index.get(index)
                if at is None:
                    at = self._by_index[index] = self._new()
            else:
                call_id = getattr(d, "id", None)
                fresh = not self.calls or (call_id and call_id != self._last_id)
                at = self._new() if fresh else len(self.calls) - 1
                self._last_id = call_id or self._last_id
            fn = getattr(d, "function", None)
            if fn is None:
                continue
            piece = getattr(fn, "arguments", None)
            if piece is not None and not isinstance(piece, str):
                piece = json.dumps(piece, ensure_ascii=False)
            self.calls[at][0] += getattr(fn, "name", None) or ""
            self.calls[at][1] += piece or ""

    def _new(self) -> int:
        self.calls.append(["", ""])
        return len(self.calls) - 1

    def text(self) -> str:
        """The calls as call blocks (:func:`~pipeline.tools.render.call_block`), in the order
        they started; arguments that are not JSON are kept as sent (the reader reports a
        botched call)."""
        return "".join(call_block(name, args) for name, args in self.calls)
