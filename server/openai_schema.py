"""The OpenAI Chat Completions request voxpipe's HTTP API accepts (pydantic), and the
OpenAI-style error it answers with.

Follows OpenAI's API reference for ``POST /v1/chat/completions``
(https://platform.openai.com/docs/api-reference/chat/create): the fields below are honoured;
fields not listed are ignored (extra="ignore"), as OpenAI-compatible servers such as vLLM do,
so clients that send e.g. ``user`` or ``presence_penalty`` work. Fields whose meaning cannot
be honoured and would silently change the answer (``n`` other than 1, ``logprobs``, ``tools``)
are refused with 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Accepted message roles → the role given to the chat template (``developer`` is OpenAI's
newer name for ``system``)."""


class TextPart(BaseModel):
    """A content part; only ``{"type": "text", "text": ...}`` is supported."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message: ``role`` (system | developer | user | assistant) and ``content`` (a
    string, or a list of text parts, joined with newlines)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def as_chat(self) -> dict[str, str]:
        """``{"role", "content"}`` as the chat template takes it."""
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": ROLES[self.role], "content": text}


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
        n: must be 1. logprobs: must be false. tools: must be absent or empty.
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
    tools: list[Any] | None = Field(default=None, max_length=0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

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
