"""The LLM stage over a remote OpenAI-compatible server: ``--llm openai:URL[#model]``.

vLLM, llama.cpp's server, Ollama, TGI or ``transformers serve`` answer instead of a model
loaded here. :class:`OpenAiLlm` implements :class:`~pipeline.stages.LlmStage` with the
``openai`` client (``AsyncOpenAI``, streaming ``POST {URL}/chat/completions``):

- **Its own event loop thread** (``voxpipe-llm-remote``) runs every request, so the stage
  works from any thread, as the in-process engine does; replies reach the session through
  the same coalescing :class:`~pipeline.llm.stream.TokenStream`.
- **Bounded:** at most ``slots`` requests are in flight to the server (``--max-batch-size``);
  up to ``queue_size`` more wait here; :meth:`OpenAiLlm.submit` raises
  :class:`~pipeline.errors.Busy` beyond that, the session's ``busy`` path.
- **Abort** (barge-in, disconnect, a cancelled reply) cancels the request's task, which
  closes its HTTP response: the server sees the connection close mid-stream and can stop
  generating.
- **Timeouts and errors:** connecting may take :data:`CONNECT_TIMEOUT_S`; the server may
  be silent at most ``LlmConfig.remote_timeout_s`` (before the first chunk and between
  chunks). A refused or reset connection, a timeout, or an HTTP error ends the stream with
  :class:`~pipeline.llm.types.RemoteLlmError` (the session's ``reply_failed`` error event).
- **The LLM breaker** (:mod:`pipeline.serving.breaker`, via ``guard`` as the governor
  attaches it) is told each request's outcome: success with its time to the first token
  (the server's queueing + prefill: what "slow" means for a remote model), failure with
  the time it took to fail (a failure after some text counts from the last chunk). So a
  dead or stalled server opens the breaker, and the governor's policies (shorter replies,
  the fallback model, a stock line) apply. An aborted request reports nothing.
- **Faults** (``--fault llm:...``) hit each request before it is sent, as a model step of
  the in-process engine.
- **Tools** (``GenRequest.tools``) go to the server as ``tools``/``tool_choice`` (OpenAI's
  format; earlier calls in ``messages`` with ``arguments`` as JSON strings); the
  ``tool_calls`` it streams back (by ``index``: id and name, then pieces of ``arguments``)
  are put together and come out after its text as ``<tool_call>`` blocks, the one format
  every consumer reads (:class:`~pipeline.tools.reply.ToolReplyReader`):
  :class:`~pipeline.llm.remote_calls.StreamedCalls`. Arguments that are not JSON are passed
  on as they are: the reader reports a botched call.

``GenStats``: ``ttft_ms`` from :meth:`submit` to the first text (or piece of a tool call),
``tpot_ms`` the mean gap between chunks after it, ``prompt_tokens``/``output_tokens`` from
the server's ``usage`` (asked for with ``stream_options.include_usage``; servers that ignore
it: the prompt counted by :attr:`OpenAiLlm.counter`, output tokens = chunks, one token per
chunk as vLLM, llama.cpp and transformers stream them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import openai

from pipeline.config import VoxpipeConfig
from pipeline.errors import Busy
from pipeline.llm.counting import Counter, load_counter
from pipeline.llm.remote_calls import StreamedCalls
from pipeline.llm.stream import TokenStream
from pipeline.llm.types import FinishReason, GenRequest, RemoteLlmError, RemoteLlmSpec, RemoteLlmUnavailable
from pipeline.serving.faults import NO_FAULTS, FaultInjector
from pipeline.serving.types import StageLoad
from pipeline.tools.render import has_tool_messages, inline_tools, openai_tool_choice, wire_message
from pipeline.tools.types import ToolSpec
from pipeline.worker import CallGuard

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
"""Longest wait for a TCP (and TLS) connection to the server (s)."""
START_TIMEOUT_S = 10.0
"""Longest wait for ``GET /models`` at start-up (s)."""
STOP_WAIT_S = 10.0
""":meth:`OpenAiLlm.stop` waits this long for the requests in flight to close (s)."""
NO_KEY = "none"
"""The API key sent when none is given (``--llm-api-key``, ``OPENAI_API_KEY``): local
servers ignore it, and the ``openai`` client refuses to start without one."""
_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class RemoteTokenStream(TokenStream):
    """A :class:`TokenStream` whose :meth:`abort` cancels the request's task (thread-safe)."""

    def __init__(self) -> None:
        super().__init__()
        self._future: concurrent.futures.Future[None] | None = None

    def bind(self, future: concurrent.futures.Future[None]) -> None:
        """The request's task (on the stage's loop); cancelled at once if already aborted."""
        self._future = future
        if self.aborted.is_set():
            future.cancel()

    def abort(self) -> None:
        """Stop the request: its task is cancelled and its HTTP response closed (idempotent)."""
        super().abort()
        if self._future is not None:
            self._future.cancel()


@dataclass(slots=True, eq=False)
class _Job:
    """One request's place in the stage: waiting for a slot until it gets one."""

    waiting: bool = True


class OpenAiLlm:
    """:class:`~pipeline.stages.LlmStage` over an OpenAI-compatible server (see the module
    docstring). Call :meth:`connect` (start-up check, blocking), then :meth:`start`.

    Args:
        spec: the server's API root and model.
        counter: prompt tokens of chat messages (:mod:`pipeline.llm.counting`).
        slots: requests in flight to the server at most.
        queue_size: requests waiting here at most; more are refused with ``Busy``.
        timeout_s: longest silence of the server on a request (s): before its first chunk,
            and between chunks.
        api_key: the Bearer token sent (None: ``OPENAI_API_KEY``, else :data:`NO_KEY`).
    """

    def __init__(self, spec: RemoteLlmSpec, counter: Counter, *, slots: int, queue_size: int,
                 timeout_s: float = 30.0, api_key: str | None = None) -> None:
        if slots < 1 or queue_size < 0 or not timeout_s > 0:
            raise ValueError("OpenAiLlm: slots >= 1, queue_size >= 0, timeout_s > 0")
        self.spec, self.counter, self.timeout_s = spec, counter, timeout_s
        self.model = spec.model or ""
        self._api_key = api_key or os.environ.get("OPENAI_API_KEY") or NO_KEY
        self._slots, self._queue_size = slots, queue_size
        self._lock = threading.Lock()
        self._waiting = self._active = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: openai.AsyncOpenAI | None = None
        self._sem: asyncio.Semaphore | None = None
        self.step_ms = 0.0  # moving average of the time per output token (ms)
        self.faults: FaultInjector = NO_FAULTS  # injected faults (tests, drills)
        self.ladder: Any = None  # the governor attaches one; a remote server has no memory ladder here
        self.guard: CallGuard | None = None  # the LLM circuit breaker: told each request's outcome

    # ---- start-up ---------------------------------------------------------------------

    def _timeout(self, read_s: float) -> openai.Timeout:
        return openai.Timeout(read_s, connect=CONNECT_TIMEOUT_S)

    def connect(self) -> str:
        """Check the server answers ``GET /models`` and settle the model name: the one given,
        else the first listed. Blocking (start-up, off the event loop). Returns the model.

        Raises:
            RemoteLlmUnavailable: unreachable, an HTTP error, no model given nor listed, or a
                model named that the server neither lists nor serves (404).
        """
        client = openai.OpenAI(base_url=self.spec.base_url, api_key=self._api_key, max_retries=0,
                               timeout=self._timeout(START_TIMEOUT_S))
        try:
            listed = [m.id for m in client.models.list()]
        except openai.NotFoundError:
            listed = []  # a server without /models still serves a model named on the command line
        except openai.OpenAIError as exc:
            raise RemoteLlmUnavailable(f"cannot use the LLM server at {self.spec.base_url}: {describe(exc)}; "
                                       "is it running? (--llm openai:URL[#MODEL])") from None
        finally:
            client.close()
        if not self.model:
            if not listed:
                raise RemoteLlmUnavailable(f"the LLM server at {self.spec.base_url} lists no model: name one, "
                                           "--llm openai:URL#MODEL")
            self.model = listed[0]
        elif self.model not in listed:
            self._probe(listed)
        logger.info("remote LLM: %s at %s", self.model, self.spec.base_url)
        return self.model

    def _probe(self, listed: list[str]) -> None:
        """The server does not list the model named: ask it for one token of it. A 404 (no such
        model) is a start-up error — it used to fail the warm-up with a traceback; anything else
        goes on with a warning (some servers answer to names they do not list, e.g. Ollama's
        ``llama3`` for ``llama3:latest``).

        Raises:
            RemoteLlmUnavailable: the server answered 404.
        """
        client = openai.OpenAI(base_url=self.spec.base_url, api_key=self._api_key, max_retries=0,
                               timeout=self._timeout(START_TIMEOUT_S))
        try:
            client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        except openai.NotFoundError as exc:
            raise RemoteLlmUnavailable(f"the LLM server at {self.spec.base_url} has no model {self.model!r} "
                                       f"({describe(exc)}); it lists {', '.join(listed[:5]) or 'none'}") from None
        except openai.OpenAIError as exc:
            logger.warning("the LLM server at %s does not list %r (it lists %s), and a test request failed (%s): "
                           "asking for it anyway", self.spec.base_url, self.model, ", ".join(listed[:5]) or "none",
                           describe(exc))
        finally:
            client.close()

    def start(self) -> None:
        """Start the stage's event loop thread (idempotent)."""
        if self._thread is not None:
            return
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            self._sem = asyncio.Semaphore(self._slots)
            self._client = openai.AsyncOpenAI(base_url=self.spec.base_url, api_key=self._api_key, max_retries=0,
                                              timeout=self._timeout(self.timeout_s))
            ready.set()
            loop.run_forever()

        self._loop = loop
        self._thread = threading.Thread(target=run, name="voxpipe-llm-remote", daemon=True)
        self._thread.start()
        ready.wait()

    def stop(self) -> None:
        """Abort every request (their streams end with ``abort``), close the client, stop
        the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=STOP_WAIT_S)
        except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError) as exc:
            logger.warning("remote LLM stop: %s", exc or type(exc).__name__)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=STOP_WAIT_S)
        loop.close()
        self._loop = self._thread = None

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._client is not None:
            await self._client.close()

    # ---- the LlmStage interface -----------------------------------------------------------

    def load(self) -> StageLoad:
        """Requests waiting here for a slot (``depth`` = ``urgent_depth``: every LLM request is
        a reply someone waits for), in flight to the server (``active``, of ``slots``), and
        ``step_ms``: the moving average of the time per output token. The server's KV cache is
        its own business (it queues what does not fit): ``kv_reserved`` 0, ``kv_budget``
        ``1 << 30`` tokens, so admission's memory check never refuses for it."""
        with self._lock:  # a request moves from waiting to active under it
            waiting, active = self._waiting, self._active
        return StageLoad(depth=waiting, urgent_depth=waiting, active=active, slots=self._slots,
                         kv_reserved=0, kv_budget=1 << 30, step_ms=self.step_ms)

    def submit(self, req: GenRequest) -> TokenStream:
        """Queue ``req``; returns its stream of text deltas (thread-safe).

        Raises:
            Busy: ``queue_size`` requests already wait for a slot.
            RuntimeError: the stage is not started.
        """
        loop = self._loop
        if loop is None:
            raise RuntimeError("the remote LLM stage is not started")
        job = _Job()
        with self._lock:
            if self._waiting >= self._queue_size:
                raise Busy(f"llm is busy: {self._waiting} requests already wait for the LLM server "
                           f"({self._slots} in flight)")
            self._waiting += 1
        stream = RemoteTokenStream()
        future = asyncio.run_coroutine_threadsafe(self._generate(req, stream, job), loop)
        future.add_done_callback(lambda f: self._done(f, stream, job))
        stream.bind(future)
        return stream

    def count_tokens(self, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> int:
        """Prompt tokens of ``messages`` with ``tools`` offered: ``--tokenizer``'s chat
        template, else the estimate of :func:`~pipeline.llm.counting.estimate_tokens` (tools
        and tool messages counted as Hermes' text: :func:`~pipeline.tools.render.inline_tools`)."""
        if tools or has_tool_messages(messages):
            messages = inline_tools(messages, tools)
        return self.counter(messages)

    def end_session(self, session: str) -> None:
        """Nothing is kept here for a session (the server's prefix cache is its own)."""

    # ---- the stage's loop ------------------------------------------------------------

    def _done(self, future: concurrent.futures.Future[None], stream: TokenStream, job: _Job) -> None:
        """A request's task ended (also when cancelled before it ran): free its place."""
        with self._lock:
            if job.waiting:
                job.waiting = False
                self._waiting -= 1
        if future.cancelled():
            if stream.stats.finish_reason is None:
                stream.stats.finish_reason = FinishReason.ABORT
            stream.end()

    async def _generate(self, req: GenRequest, stream: TokenStream, job: _Job) -> None:
        assert self._sem is not None
        async with self._sem:
            with self._lock:
                job.waiting = False
                self._waiting -= 1
                self._active += 1
            try:
                await self._request(req, stream)
            finally:
                with self._lock:
                    self._active -= 1

    def _params(self, req: GenRequest) -> dict[str, Any]:
        messages = [wire_message(m) for m in req.messages]
        params: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": req.max_new_tokens,
                                  "temperature": req.temperature, "stream": True,
                                  "stream_options": {"include_usage": True}}
        if req.temperature > 0:
            params.update(top_p=req.top_p, seed=req.seed)
        if req.stop:
            params["stop"] = req.stop[:4]  # the OpenAI API takes up to 4 stop sequences
        if req.tools:  # relayed: the server's calls come back as call blocks in the text (_request)
            params["tools"] = [spec.to_openai() for spec in req.tools]
            params["tool_choice"] = openai_tool_choice(req.tool_choice)
        return params

    async def _request(self, req: GenRequest, stream: TokenStream) -> None:
        """Send ``req``, put its text into ``stream``, end the stream; tell the breaker."""
        assert self._client is not None
        st = stream.stats
        t0 = time.perf_counter()
        first = last = None
        chunks = 0
        usage: Any = None
        finish: str | None = None
        calls = StreamedCalls()
        try:
            if self.faults.active:
                await asyncio.to_thread(self.faults.hit, "llm")  # a slow rule sleeps: not on this loop
            response = await self._client.chat.completions.create(**self._params(req))
            async with response:  # leaving it closes the HTTP response, also when cancelled (abort)
                async for chunk in response:
                    usage = chunk.usage or usage
                    for choice in chunk.choices:
                        finish = choice.finish_reason or finish
                        text = choice.delta.content if choice.delta is not None else None
                        pieces = choice.delta.tool_calls if choice.delta is not None else None
                        if not text and not pieces:
                            continue
                        last = time.perf_counter()  # a piece of a call is output too (ttft, tpot, breaker)
                        if first is None:
                            first = last
                            st.ttft_ms = (last - stream.submitted) * 1000
                            self._record(last - t0, False)
                        chunks += 1
                        if pieces:
                            calls.add(pieces)
                        if text:
                            stream.put(text)
        except asyncio.CancelledError:
            st.finish_reason = FinishReason.ABORT
            stream.end()
            raise
        except Exception as exc:  # noqa: BLE001 - every failure of the server ends this reply only
            self._record(time.perf_counter() - (last or t0), True)
            if first is None:
                what = describe(exc, self.timeout_s)
            elif isinstance(exc, openai.APITimeoutError) or "Timeout" in type(exc).__name__:
                what = f"the reply stalled: no text for {self.timeout_s:g} s (timed out)"
            else:
                what = f"the reply broke off ({root_cause(exc)})"
            error = RemoteLlmError(f"LLM server {self.spec.base_url}: {what}")
            logger.warning("%s", error)
            st.finish_reason = FinishReason.ERROR
            stream.end(error)
            return
        if calls.calls:  # the server's tool calls, as call blocks after its text
            stream.put(calls.text())
        if first is None:  # an empty reply: the call still succeeded
            self._record(time.perf_counter() - t0, False)
        st.output_tokens = int(getattr(usage, "completion_tokens", 0) or chunks)
        st.prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0) or await asyncio.to_thread(
            self.counter, req.messages)
        if first is not None and last is not None and st.output_tokens > 1:
            st.tpot_ms = (last - first) * 1000 / (st.output_tokens - 1)
            self.step_ms = st.tpot_ms if self.step_ms == 0.0 else self.step_ms + 0.1 * (st.tpot_ms - self.step_ms)
        st.finish_reason = _FINISH.get(finish or "stop", FinishReason.STOP)
        stream.end()

    def _record(self, duration_s: float, failed: bool) -> None:
        if self.guard is not None:
            self.guard.record(duration_s, failed)


def describe(exc: BaseException, timeout_s: float | None = None) -> str:
    """``exc`` of the ``openai`` client (or its HTTP transport) in a few words for people:
    a timeout, an HTTP status, an unreachable server, or the exception itself."""
    name = type(exc).__name__
    if isinstance(exc, openai.APITimeoutError) or "Timeout" in name:
        return "no answer in time" + (f" (timed out after {timeout_s:g} s of silence)" if timeout_s else "")
    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    if isinstance(exc, openai.APIConnectionError):
        return f"cannot connect ({root_cause(exc)})"
    return root_cause(exc)


def root_cause(exc: BaseException) -> str:
    """The innermost cause of ``exc`` (``__cause__``/``__context__``, an exception group's
    first) as ``Name: message``, or the bare name when its message is empty: e.g.
    ``ConnectionRefusedError: [Errno 111] ...`` under the client's "Connection error."."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        group = getattr(exc, "exceptions", None)
        inner = exc.__cause__ or exc.__context__ or (group[0] if group else None)
        if not isinstance(inner, BaseException):
            break
        exc = inner
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def open_remote_llm(cfg: VoxpipeConfig) -> OpenAiLlm:
    """The stage for ``cfg.llm.model = "openai:URL[#model]"``, its server checked (not started).
    Blocking: start-up only.

    Raises:
        ValueError: a bad ``openai:`` spec.
        RemoteLlmUnavailable: the server cannot be used, or ``--tokenizer`` cannot be loaded.
    """
    spec = RemoteLlmSpec.parse(cfg.llm.model)
    try:
        counter = load_counter(cfg.llm.tokenizer)
    except (OSError, ValueError) as exc:
        raise RemoteLlmUnavailable(str(exc)) from None
    stage = OpenAiLlm(spec, counter, slots=cfg.llm_batch.max_batch_size, queue_size=cfg.llm.queue_size,
                      timeout_s=cfg.llm.remote_timeout_s, api_key=cfg.llm.api_key)
    stage.connect()
    return stage
