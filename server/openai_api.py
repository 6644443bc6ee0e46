"""voxpipe's own LLM as an OpenAI-compatible HTTP API: ``GET /v1/models`` and
``POST /v1/chat/completions`` (JSON, or Server-Sent Events with ``stream``), an ASGI app on
the server's port (:mod:`server.http_front` routes ``/v1/...`` to it); beside them
``GET /v1/voices``, the voices sessions may choose (``session.start.voice``).

A completion is one more request to the same continuously batching engine the voice
sessions use (``engines.llm.submit``), so text clients and voice turns share its batch, and
it passes the same gates, in this order, before any work is spent on it (docs/OPENAI.md):

1. the edge (:class:`~server.edge.EdgeGuard`: ``Host``, ``Origin``, the bearer token —
   the ``openai`` client's ``api_key`` is sent as ``Authorization: Bearer``): 400/401/403;
2. validation (:class:`~server.openai_schema.ChatCompletionRequest`; the ``model`` must be
   the one ``/v1/models`` lists): 400, 404 for another model;
3. the service level: warming up → 503; the LLM's circuit breaker open → 503 ``breaker``;
   then admission as for a typed turn (:class:`~pipeline.session.gate.TurnGate`: an
   out-of-memory ladder refusing, the SLO prediction, the concurrency limit, the KV budget)
   → 503 with ``Retry-After`` (429 for a client-side ``rate_limited`` reason); the engine's
   queue full (``Busy``) → 503 ``stage``;
4. the context budget (``--max-new-tokens`` caps ``max_tokens``; the prompt, counted with the
   model's chat template, + the completion must fit ``LlmConfig.max_context_tokens``):
   400 ``context_length_exceeded``.

A client that disconnects (mid-stream or while waiting) aborts its generation: the engine
frees the batch slot at its next step.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from pipeline import metrics
from pipeline.errors import Busy
from pipeline.llm.types import PRIORITY_TEXT, FinishReason, GenRequest, GenStats
from pipeline.serving.breaker import State
from pipeline.session.gate import TurnGate
from pipeline.session.types import TurnHooks
from pipeline.stages import TextStream
from pipeline.tools.types import ToolCall, ToolSpec

from .http_front import BODY_TIMEOUT_S
from .openai_schema import ApiError, ChatCompletionRequest, ErrorType
from .openai_tools import CompletionReader, call_delta
from .types import ApiHost

HTTP_SESSION = "http-api"
"""The session id admission logs for HTTP API requests (they hold no session state)."""
CLIENT_GONE = 499
"""The status counted for a request whose client left before it was read (nginx's convention)."""
OWNER = "voxpipe"
"""``owned_by`` of the listed model."""
_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
STATUS_TYPE: dict[int, ErrorType] = {400: "invalid_request_error", 401: "authentication_error",
                                      403: "permission_error"}


def model_id(model: str) -> str:
    """The id ``/v1/models`` lists for ``LlmConfig.model``: the name (``qwen``,
    ``smollm2``), a remote server's model (``openai:URL#model``), or a model folder's last part."""
    if "#" in model:
        return model.rsplit("#", 1)[1]
    return Path(model).name if ("/" in model or "\\" in model) else model


def _retry_after(ms: float) -> dict[str, str]:
    """``Retry-After`` in whole seconds (RFC 9110 §10.2.3), at least 1."""
    return {"Retry-After": str(max(1, math.ceil(ms / 1000)))}


def _refused(status: int, message: str, reason: str, retry_after_ms: float) -> ApiError:
    """A refused completion (counted as a refused turn, by reason): 503, or 429 for a
    reason of the client's own; ``Retry-After`` from the refusal's hint."""
    metrics.ADMISSIONS.labels("refused", reason).inc()
    return ApiError(status, message, type="rate_limit_error" if status == 429 else "server_error", code=reason,
                    headers=_retry_after(retry_after_ms))


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status, headers={"Cache-Control": "no-store", **(headers or {})})


def error_response(exc: ApiError) -> JSONResponse:
    return _json(exc.status, exc.body(), exc.headers)


@dataclass(slots=True)
class _Admitted:
    """A completion admitted and submitted: its stream and what the answer reports."""

    stream: TextStream
    hooks: TurnHooks
    prompt_tokens: int
    id: str
    created: int
    model: str
    tools: tuple[ToolSpec, ...] = ()
    """The tools offered (none: the text is the answer as it is)."""

    def usage(self, stats: GenStats) -> dict[str, int]:
        prompt = stats.prompt_tokens or self.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": stats.output_tokens,
                "total_tokens": prompt + stats.output_tokens}

    def chunk(self, delta: dict[str, Any], finish: str | None, usage: bool) -> bytes:
        body: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                                "model": self.model, "system_fingerprint": None,
                                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        if usage:
            body["usage"] = None
        return _sse(body)


def _sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def _finish(stats: GenStats) -> str:
    """The OpenAI ``finish_reason`` of an ended stream (an abort or error raises instead).

    Raises:
        ApiError: 500 the generation was aborted (the engine stopped) or failed.
    """
    if stats.finish_reason is None:
        return "stop"
    finish = _FINISH.get(stats.finish_reason)
    if finish is None:
        raise ApiError(500, f"the generation ended early ({stats.finish_reason})", type="server_error",
                       code=str(stats.finish_reason))
    return finish


def _observe(stats: GenStats) -> None:
    """The engine's reply metrics, as for a voice reply."""
    metrics.LLM_TTFT.observe(stats.ttft_ms / 1000)
    if stats.tpot_ms:
        metrics.LLM_TPOT.observe(stats.tpot_ms / 1000)


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (``http.disconnect``)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def _abort_when_gone(receive: Receive, stream: TextStream) -> asyncio.Task[None]:
    """A task that aborts ``stream`` as soon as the client disconnects (cancel it once
    the answer is out)."""
    def done(task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            stream.abort()

    gone = asyncio.ensure_future(_disconnected(receive))
    gone.add_done_callback(done)
    return gone


class OpenAiApi:
    """The endpoints over one server (:class:`~server.types.ApiHost`: its engines, admission,
    governor and edge).

    Args:
        server: the server whose LLM, admission and governor the requests use.
    """

    def __init__(self, server: ApiHost) -> None:
        self.server = server
        self.gate = TurnGate(server.admission, server.engines, server.cfg, HTTP_SESSION, server.governor)
        self.model = model_id(server.cfg.llm.model)

    # ---- endpoints ----------------------------------------------------------------------

    def _card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": 0, "owned_by": OWNER}

    async def models(self, request: Request) -> Response:
        """``GET /v1/models``: the main LLM."""
        return _json(200, {"object": "list", "data": [self._card()]})

    async def model_info(self, request: Request) -> Response:
        """``GET /v1/models/{id}``: the model, or 404."""
        self._check_model(request.path_params["model_id"], param=None)
        return _json(200, self._card())

    async def voices(self, request: Request) -> Response:
        """``GET /v1/voices``: the server's voices, default first
        (:meth:`~pipeline.tts.catalogue.VoiceCatalogue.as_json`: ``{"object": "list", "data":
        [{"name", "language", "backend", "sample_rate"}, ...], "default": name}``; an empty
        list where the TTS stage does not say: a remote or Coqui stage)."""
        return _json(200, self.server.engines.voices.as_json())

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions`` (see the module docstring)."""
        req = await self._parse(request)
        self._check_model(req.model, param="model")
        admitted = await self._admit(req)
        if req.stream:
            return _SseReply(self._chunks(admitted, req.include_usage), admitted.stream)
        return await self._complete(admitted, request.receive)

    # ---- steps ------------------------------------------------------------------------

    async def _parse(self, request: Request) -> ChatCompletionRequest:
        limit = self.server.cfg.server.max_message_bytes
        body = bytearray()
        try:
            async with asyncio.timeout(BODY_TIMEOUT_S):  # a body that trickles in, or stops short
                async for piece in request.stream():
                    body += piece
                    if len(body) > limit:
                        raise ApiError(413, f"request body over {limit} bytes")
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
                           code="request_timeout") from None
        except ClientDisconnect:  # gone before its whole request: nobody to answer (499, as nginx logs it)
            raise ApiError(CLIENT_GONE, "the client closed the connection before sending its whole request") from None
        try:
            data = json.loads(body)
            # a lone surrogate ("\ud800") is JSON but not text: the tokenizer (and a UTF-8
            # answer echoing it) would fail on it later, as a 500
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the body is not valid Unicode text (a lone surrogate such as \\ud800)") from None
        except RecursionError:
            raise ApiError(400, "the body is not valid JSON: nested too deeply") from None
        except ValueError as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "the body must be a JSON object")
        try:
            return ChatCompletionRequest.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err["loc"]) or None
            raise ApiError(400, f"invalid {param or 'request'}: {err['msg']}", param=param,
                           code="invalid_value") from None

    def _check_model(self, name: str, *, param: str | None) -> None:
        if name not in (self.model, self.server.cfg.llm.model):
            raise ApiError(404, f"The model '{name[:200]}' does not exist (this server serves '{self.model}')",
                           param=param, code="model_not_found")

    def _refuse_busy(self) -> None:
        """Raise the 503 :class:`ApiError` of a server that cannot take a completion now
        (warming up, LLM breaker open)."""
        server = self.server
        if not server.ready:
            raise ApiError(503, "the server is warming up; try again shortly", type="server_error",
                           code="not_ready", headers=_retry_after(5000))
        guard = server.governor.guards["llm"]
        if guard.state() is State.OPEN:
            raise _refused(503, "the LLM is failing (its circuit breaker is open); try again later", "breaker",
                           guard.open_left_s() * 1000)

    async def _admit(self, req: ChatCompletionRequest) -> _Admitted:
        """Gate, count and submit ``req`` (raises :class:`ApiError` when refused)."""
        key = object()
        self._refuse_busy()
        messages = [m.as_chat() for m in req.messages]
        tools = req.tool_specs if req.choice != "none" else ()
        chars = sum(len(m["content"]) for m in messages) + sum(len(json.dumps(t.parameters)) for t in tools)
        refusal = self.gate.check(spoken=False, since_end_ms=0.0, key=key, prompt_chars=chars)
        if refusal is not None:
            raise _refused(429 if refusal.reason == "rate_limited" else 503, refusal.message, refusal.reason,
                           refusal.retry_after_ms)
        hooks = self.gate.hooks(key)
        try:
            llm = self.server.engines.llm
            prompt = await asyncio.to_thread(llm.count_tokens, messages, tools)
            max_new = self._max_new(req, prompt)
            gen = GenRequest(messages=messages, max_new_tokens=max_new, temperature=req.temperature,
                             top_p=req.top_p, seed=req.seed or 0, stop=req.stops, priority=PRIORITY_TEXT,
                             tools=tools, tool_choice=req.choice if tools else "auto")
            try:
                stream = llm.submit(gen)
            except Busy as exc:
                raise _refused(503, str(exc), exc.reason, exc.retry_after_ms) from None
            finally:
                if hooks.on_submit is not None:
                    hooks.on_submit()
        except BaseException:
            if hooks.on_end is not None:
                hooks.on_end()
            raise
        return _Admitted(stream, hooks, prompt, f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.model, tools)

    def _max_new(self, req: ChatCompletionRequest, prompt: int) -> int:
        """The completion's token limit: the client's, capped by the service level's
        (``--max-new-tokens``, less while the server degrades), within the context budget."""
        ctx = self.server.cfg.llm.max_context_tokens
        cap = self.server.governor.turn_policy().max_new_tokens
        requested = req.requested_tokens
        max_new = min(cap, requested) if requested is not None else min(cap, ctx - prompt)
        if prompt + max(1, max_new) > ctx:
            raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, you requested "
                                f"{prompt + max(1, max_new)} tokens ({prompt} in the messages, {max(1, max_new)} in "
                                "the completion). Please reduce the length of the messages or completion.",
                           param="messages", code="context_length_exceeded")
        return max_new

    async def _complete(self, adm: _Admitted, receive: Receive) -> Response:
        """The whole ``chat.completion``; a client gone meanwhile aborts the generation."""
        gone = _abort_when_gone(receive, adm.stream)
        finished = False
        reader = CompletionReader(adm.tools)
        try:
            text, first = "", True
            async for delta in adm.stream:
                if first and adm.hooks.on_end is not None:
                    adm.hooks.on_end()  # the client has its first token: no longer waiting
                first = False
                text += "".join(p for p in reader.feed(delta) if isinstance(p, str))
            text += "".join(p for p in reader.finish() if isinstance(p, str))
            finished = True
            if gone.done() and not gone.cancelled():  # aborted for a client that left: nobody to answer
                raise ApiError(CLIENT_GONE, "the client closed the connection before the answer")
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine's error, reported to this client only
            raise ApiError(500, f"the generation failed: {exc}", type="server_error", code="llm_failed") from None
        finally:
            gone.cancel()
            if not finished:
                adm.stream.abort()
            if adm.hooks.on_end is not None:
                adm.hooks.on_end()
        stats = adm.stream.stats
        finish = reader.finish_reason or _finish(stats)
        _observe(stats)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if reader.calls:
            message.update(content=text or None, tool_calls=[c.to_openai() for c in reader.calls])
        return _json(200, {
            "id": adm.id, "object": "chat.completion", "created": adm.created, "model": adm.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
            "usage": adm.usage(stats)})

    async def _chunks(self, adm: _Admitted, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE events of a streamed completion, ``data: [DONE]`` last (an ``error``
        event instead when the generation fails)."""
        finished = False
        reader = CompletionReader(adm.tools)

        def chunks(parts: list[str | ToolCall]) -> list[bytes]:  # a call's index: its place among the calls
            return [adm.chunk({"content": p} if isinstance(p, str) else call_delta(reader.calls.index(p), p), None,
                              include_usage) for p in parts if p]

        try:
            yield adm.chunk({"role": "assistant", "content": ""}, None, include_usage)
            first = True
            async for delta in adm.stream:
                if first and adm.hooks.on_end is not None:
                    adm.hooks.on_end()
                first = False
                for chunk in chunks(reader.feed(delta)):
                    yield chunk
            for chunk in chunks(reader.finish()):
                yield chunk
            finished = True
            stats = adm.stream.stats
            finish = reader.finish_reason or _finish(stats)
            _observe(stats)
            yield adm.chunk({}, finish, include_usage)
            if include_usage:
                yield _sse({"id": adm.id, "object": "chat.completion.chunk", "created": adm.created,
                            "model": adm.model, "system_fingerprint": None, "choices": [],
                            "usage": adm.usage(stats)})
            yield _sse("[DONE]")
        except ApiError as exc:
            yield _sse(exc.body())
        except Exception as exc:  # noqa: BLE001 - the engine's error, reported to this client only
            yield _sse(ApiError(500, f"the generation failed: {exc}", type="server_error", code="llm_failed").body())
        finally:
            if not finished:
                adm.stream.abort()
            if adm.hooks.on_end is not None:
                adm.hooks.on_end()


class _SseReply(Response):
    """A Server-Sent Events answer sent as ``chunks`` come; the client's disconnect aborts
    ``stream`` at once (even while no chunk is due), and the sending stops."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncIterator[bytes], stream: TextStream) -> None:
        self.chunks, self.stream = chunks, stream
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = _abort_when_gone(receive, self.stream)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in self.chunks:
                if gone.done():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            await cast(Any, self.chunks).aclose()  # (aborts the stream unless it finished)
