"""The OpenAI Chat Completions request voxpipe's HTTP API accepts (pydantic), and the
OpenAI-style error it answers with.

Follows OpenAI's API reference for ``POST /v1/chat/completions``
(https://platform.openai.com/docs/api-reference/chat/create): the fields below are honoured;
fields not listed are ignored (extra="ignore"), as OpenAI-compatible servers such as vLLM do,
so clients that send e.g. ``user`` or ``presence_penalty`` work. Fields whose meaning cannot
be honoured and would silently change the answer (``n`` other than 1, ``logprobs``) are
refused with 400. Function tools (``tools``, ``tool_choice``, assistant ``tool_calls`` and
``role: tool`` messages) follow the function-calling guide
(https://platform.openai.com/docs/guides/function-calling).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pipeline.tools.types import TOOL_NAME, ToolSpec
from pipeline.tools.validate import schema_error

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
"""Accepted message roles → the role given to the chat template (``developer`` is OpenAI's
newer name for ``system``)."""


class TextPart(BaseModel):
    """A content part; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """A call's function: its ``name`` and ``arguments`` (a JSON object, as a string)."""

    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, v: str) -> str:
        try:
            ok = isinstance(json.loads(v or "{}"), dict)
        except (ValueError, RecursionError):
            ok = False
        if not ok:
            raise ValueError("arguments must be a JSON object, as a string")
        return v


class ToolCallItem(BaseModel):
    """An assistant message's ``tool_calls`` item."""

    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One message: ``role`` (system | developer | user | assistant | tool) and ``content`` (a
    string, or a list of text parts, joined with newlines; may be null for an assistant turn
    that made ``tool_calls``); a ``tool`` message answers the call ``tool_call_id``."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        return self

    @property
    def text(self) -> str:
        """The content as one string ('' for none)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def as_chat(self) -> dict[str, Any]:
        """The message as the chat template takes it: ``{"role", "content"}``, with
        ``tool_calls`` (arguments decoded to objects) or ``tool_call_id`` where it has them."""
        out: dict[str, Any] = {"role": ROLES[self.role], "content": self.text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": json.loads(c.function.arguments or "{}")}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class FunctionDef(BaseModel):
    """A function tool's ``function``: name, description, JSON Schema ``parameters``."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=TOOL_NAME.pattern)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class FunctionTool(BaseModel):
    """A ``tools`` item: ``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedChoice(BaseModel):
    """``tool_choice`` naming one function: ``{"type": "function", "function": {"name": ...}}``."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: dict[str, str]


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the token usage."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """The request body.

    Attributes:
        model: the served model's id (``GET /v1/models``).
        messages: the conversation, at least one message.
        stream: answer with Server-Sent Events (``chat.completion.chunk``).
        max_tokens / max_completion_tokens: most tokens to generate (the latter wins when
            both are given); capped by the server's ``--max-new-tokens``.
        temperature: 0..2; 0 (the default here, unlike OpenAI's 1) is greedy.
        top_p: (0, 1]. seed: the sampler's seed when sampling (a 64-bit signed integer).
        stop: a string or up to 4 strings that end the reply (not included in it).
        n: must be 1. logprobs: must be false.
        tools: function tools the model may call (at most 64); tool_choice: ``auto`` (the
            default with tools), ``none``, ``required`` or one named function.
    """

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as OpenAI (torch refuses more)
    stop: str | list[str] | None = None
    n: Literal[1] = 1
    logprobs: Literal[False] | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("messages")
    @classmethod
    def _answers(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        """A ``tool`` message answers a call an earlier assistant message made (OpenAI: 400)."""
        made: set[str] = set()
        for i, m in enumerate(messages):
            made |= {c.id for c in m.tool_calls or []}
            if m.role == "tool" and m.tool_call_id not in made:
                raise ValueError(f"message {i} answers tool_call_id {str(m.tool_call_id)[:64]!r}, which no earlier "
                                 "assistant message's tool_calls made")
        return messages

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [t.function.name for t in tools or []]
        if len(set(names)) != len(names):
            raise ValueError("two functions have the same name")
        for tool in tools or []:
            params = tool.function.parameters
            if params.get("type") != "object":
                raise ValueError(f"{tool.function.name}'s parameters must be a JSON Schema with type object")
            problem = schema_error(params)
            if problem is not None:
                raise ValueError(f"{tool.function.name}'s parameters is not a JSON Schema ({problem})")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(choice, NamedChoice) and choice.function.get("name") not in names:
            raise ValueError(f"names {choice.function.get('name')!r}, which is not among the tools")
        if choice == "required" and not names:
            raise ValueError("'required' needs tools")
        return choice

    @property
    def tool_specs(self) -> tuple[ToolSpec, ...]:
        """The tools offered (as specs; ``tool_choice: none`` keeps them out of the prompt)."""
        return tuple(ToolSpec(t.function.name, t.function.description, t.function.parameters)
                     for t in self.tools or [])

    @property
    def choice(self) -> str:
        """``tool_choice`` as :attr:`~pipeline.llm.types.GenRequest.tool_choice` takes it:
        ``auto`` (the default), ``none``, ``required`` or the function's name."""
        if isinstance(self.tool_choice, NamedChoice):
            return self.tool_choice.function["name"]
        return self.tool_choice or "auto"

    @property
    def stops(self) -> list[str]:
        """The stop strings as a list (empty ones dropped)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if s]

    @property
    def requested_tokens(self) -> int | None:
        """The client's token limit (``max_completion_tokens``, else ``max_tokens``), None if neither."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


ErrorType = Literal["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
                    "rate_limit_error", "server_error", "overloaded_error"]


class ApiError(Exception):
    """An error answer: HTTP ``status`` and OpenAI's error object
    ``{"error": {"message", "type", "param", "code"}}``; ``headers``: extra response
    headers (``Retry-After``, ``WWW-Authenticate``)."""

    def __init__(self, status: int, message: str, *, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
