"""``voxpipe mic``'s lines for a reply's tool calls (``tool.call``, ``tool.output``:
docs/PROTOCOL.md "Tool calls"): one line when the model calls a tool, one when its result
(or its error) comes back, as they happen::

      tool: set_timer(minutes=5)
      tool: set_timer -> {"summary": "A timer for 5 minutes is set. It rings at 12:05.", ...} (3 ms)
      tool error: explode failed: RuntimeError: exploded (1 ms)
"""

from __future__ import annotations

import json
from typing import Any

MAX_SHOWN = 200
"""Characters of a result (or an error) shown; longer ones end with "…"."""
MAX_ARG = 60
"""Characters of one argument's value shown."""


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())  # one line, whatever the tool returned
    return text if len(text) <= limit else text[:limit - 1] + "…"


def call_text(name: str, arguments: dict[str, Any] | None) -> str:
    """A call as it reads in code: ``name(key=value, ...)``, each value as JSON."""
    parts = (f"{k}={_clip(json.dumps(v, ensure_ascii=False), MAX_ARG)}" for k, v in (arguments or {}).items())
    return f"{name}({', '.join(parts)})"


def tool_call_line(ev: dict) -> str:
    """The line for a ``tool.call`` event (a call the client is to run says so)."""
    where = " (runs on the client)" if ev.get("runs_on") == "client" else ""
    return f"  tool: {call_text(ev.get('name', '?'), ev.get('arguments'))}{where}"


def tool_output_line(ev: dict) -> str:
    """The line for a ``tool.output`` event: the result as the model got it, or what went
    wrong, and how long the call took."""
    ms = f" ({ev['ms']:.0f} ms)" if isinstance(ev.get("ms"), int | float) else ""
    if ev.get("error"):
        return f"  tool error: {_clip(str(ev['error']), MAX_SHOWN)}{ms}"  # the error names the tool
    return f"  tool: {ev.get('name', '?')} -> {_clip(str(ev.get('output', '')), MAX_SHOWN)}{ms}"


def tool_line(ev: dict) -> str:
    """The line for a ``tool.call`` or a ``tool.output`` event."""
    return tool_call_line(ev) if ev.get("type") == "tool.call" else tool_output_line(ev)
