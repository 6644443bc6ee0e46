"""Messages of tool calling: a tool's description (:class:`ToolSpec`), a call the model made
(:class:`ToolCall`) or botched (:class:`ToolCallError`), and what the stream parser emits
(:class:`Text`, :class:`ToolBlock`). The wire shapes are OpenAI's function tools
(platform.openai.com/docs/guides/function-calling), which Hugging Face chat templates take
as ``tools=``."""

from __future__ import annotations

import enum
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""What OpenAI accepts as a function name (and what a template can quote without escaping)."""


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool the model may call.

    Attributes:
        name: the function name (:data:`TOOL_NAME`: letters, digits, ``_``, ``-``; ≤ 64).
        description: what it does, for the model.
        parameters: JSON Schema of its arguments: an object schema.
        example: something a person says that this tool answers, and the call's arguments
            (:func:`~pipeline.tools.spec.example`): shown to the model as a worked example
            (:func:`~pipeline.tools.render.demo_exchange`). None: none.

    Raises:
        ValueError: a bad name, or ``parameters`` that is not an object schema.
    """

    name: str
    description: str
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    example: tuple[str, dict[str, Any]] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not TOOL_NAME.match(self.name):
            raise ValueError(f"tool name {self.name!r}: use 1-64 letters, digits, '_' or '-'")
        if self.parameters.get("type") != "object":
            raise ValueError(f"tool {self.name}: parameters must be a JSON Schema with \"type\": \"object\"")

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def new_call_id() -> str:
    """A fresh call id, ``call_`` and 24 hex digits (OpenAI's ids look alike)."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A well-formed call: a known tool, arguments valid under its schema.

    Attributes:
        id: the call's id (ties the tool's result message to it).
        name: the tool called.
        arguments: the decoded arguments.
        raw: the text the model wrote between its call tags.
    """

    id: str
    name: str
    arguments: dict[str, Any]
    raw: str = ""

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``tool_calls`` item: ``arguments`` as a JSON string, as on its wire."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments, ensure_ascii=False)}}


class ToolCallFault(enum.StrEnum):
    """What was wrong with a call."""

    NOT_JSON = "not_json"
    """Not JSON, or JSON that is not ``{"name": str, "arguments": object}``."""
    UNKNOWN_TOOL = "unknown_tool"
    """A name no offered tool has."""
    SCHEMA = "schema"
    """Arguments that the tool's JSON Schema rejects."""


@dataclass(frozen=True, slots=True)
class ToolCallError:
    """A malformed call (the model gets one repair attempt, then the user hears an apology).

    Attributes:
        reason: the :class:`ToolCallFault`.
        message: what was wrong, in words the model can act on.
        raw: the text the model wrote between its call tags.
        name: the tool it named, if it named one.
    """

    reason: ToolCallFault
    message: str
    raw: str = ""
    name: str | None = None


@dataclass(frozen=True, slots=True)
class Text:
    """Reply text outside any call block: to be spoken."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolBlock:
    """The text between ``<tool_call>`` and ``</tool_call>``; ``closed`` False when the stream
    ended inside the block."""

    raw: str
    closed: bool = True


Event = Text | ToolBlock
"""What :class:`~pipeline.tools.parse.ToolCallParser` emits."""
