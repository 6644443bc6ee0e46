"""The LLM stage: one engine thread streams replies for every session, batched.

Sessions :meth:`LlmEngine.submit` a :class:`GenRequest` and iterate the returned
:class:`TokenStream` for text deltas; :meth:`TokenStream.abort` (disconnect, cancel,
barge-in) stops its generation at the next token step.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass

from pipeline import metrics
from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.llm.detok import IncrementalDetokenizer, StopStrings
from pipeline.llm.runner.runner import ModelRunner
from pipeline.llm.scheduler import Scheduler
from pipeline.llm.types import GenRequest, GenStats, SamplingParams, SchedRequest, State
from pipeline.worker import Busy

logger = logging.getLogger(__name__)






class TokenStream:
    """Async iterator of text deltas for one request; ends when generation ends.

    Raises the engine's exception from ``__anext__`` if generation failed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._q: asyncio.Queue = asyncio.Queue()
        self.aborted = threading.Event()
        self.stats = GenStats()
        self.submitted = time.perf_counter()
        self._wake: threading.Event | None = None

    def abort(self) -> None:
        """Stop generating at the next token step (thread-safe, idempotent)."""
        self.aborted.set()
        if self._wake is not None:
            self._wake.set()

    def _put(self, item) -> None:  # called from the engine thread
        self._loop.call_soon_threadsafe(self._q.put_nowait, item)

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> str:
        item = await self._q.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item


class LlmEngine:
    """The process-wide LLM stage: continuous batching in one engine thread.

    Each step the :class:`~pipeline.llm.scheduler.Scheduler` plans who joins, decodes or
    leaves; the :class:`~pipeline.llm.runner.runner.ModelRunner` executes the plan; the loop turns
    sampled tokens into exact text deltas (stop strings applied) for each stream.
    An aborted stream leaves the batch at the next step and its KV rows are freed.

    Args:
        llm: a :class:`pipeline.llm.loader.LoadedLLM`.
        cfg: queue size and defaults (see :class:`LlmConfig`).
        sched: batching knobs (see :class:`SchedulerConfig`).
    """

    def __init__(self, llm, cfg: LlmConfig, sched: SchedulerConfig | None = None) -> None:
        self.llm = llm
        self.cfg = cfg
        self.tokenizer = llm.tokenizer
        self.scheduler = Scheduler(sched or SchedulerConfig())
        pad = self.tokenizer.pad_token_id
        eos = llm.model.generation_config.eos_token_id
        self.eos_ids = frozenset((eos if isinstance(eos, list) else [eos]) + [self.tokenizer.eos_token_id]) - {None}
        self.runner = ModelRunner(llm.model, llm.device, pad if pad is not None else min(self.eos_ids))
        self._inbox: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._live: dict[int, _Live] = {}
        self._probes: dict[str | None, list[int]] = {}
        self._next_rid = 0
        self.steps = 0
        self._trimmed_at = 0
        self.batch_sizes: list[int] = []  # per step: requests in the step (benchmark, tests)
        self.token_log: list[tuple[float, int]] = []  # per step: (perf_counter at its end, tokens sampled)

    @property
    def depth(self) -> int:
        """Requests waiting to join the batch."""
        return self._inbox.qsize() + len(self.scheduler.waiting)

    @property
    def active(self) -> int:
        """Requests in the batch right now (decoding, or prefilling their prompt)."""
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="voxpipe-llm", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread; unfinished streams end with ``abort``."""
        if self._thread is not None:
            self._stop = True
            self._wake.set()
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, req: GenRequest) -> TokenStream:
        """Queue a request; returns its stream of text deltas.

        Raises:
            Busy: `queue_size` requests are already waiting for a batch slot.
        """
        stream = TokenStream(asyncio.get_running_loop())
        stream._wake = self._wake
        try:
            if self.depth >= self._inbox.maxsize:  # the bound covers requests waiting for a slot too
                raise queue.Full
            self._inbox.put_nowait((req, stream))
        except queue.Full:
            raise Busy(f"llm is busy: {self._inbox.maxsize} requests already queued") from None
        self._wake.set()
        return stream

    def count_tokens(self, messages: list[dict]) -> int:
        """Prompt tokens of ``messages`` under the model's chat template."""
        return len(self._prompt_ids(messages))

    def _prompt_ids(self, messages: list[dict]) -> list[int]:
        enc = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(enc, dict) or hasattr(enc, "keys"):
            enc = enc["input_ids"]
        return list(enc)

    def _prefix_len(self, messages: list[dict], ids: list[int]) -> int:
        """Tokens of ``ids`` shared by every request with the same system prompt: the
        template's system block and the opening of the first user turn (the runner keeps
        their KV in its prefix cache)."""
        system = messages[0]["content"] if messages and messages[0].get("role") == "system" else None
        probe = self._probes.get(system)
        if probe is None:
            msgs = ([] if system is None else [messages[0]]) + [{"role": "user", "content": ""}]
            probe = self._prompt_ids(msgs)
            if len(self._probes) >= 64:
                self._probes.clear()
            self._probes[system] = probe
        n = 0
        for a, b in zip(ids, probe):
            if a != b:
                break
            n += 1
        return n if n < len(ids) else 0

    # ---- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop:
                self._admit()
                self._reap_aborts()
                plan = self.scheduler.schedule()
                if plan.empty:
                    idle = not self.scheduler.has_work()
                    if idle and self.steps != self._trimmed_at:
                        self._trimmed_at = self.steps
                        release_free_memory()
                    self._wake.wait(None if idle else (plan.wait_s or 0.001))
                    self._wake.clear()
                    continue
                try:
                    outputs = self.runner.execute(plan)
                except Exception as exc:
                    logger.exception("llm step failed")
                    self._fail_all(exc)
                    continue
                self.steps += 1
                size = len(plan.decode) + len(plan.prefill)  # 0: the step only freed rows
                if size:
                    metrics.LLM_BATCH.observe(size)
                sampled = self.scheduler.update(plan, outputs)
                if size and len(self.batch_sizes) < 100_000:
                    self.batch_sizes.append(size)
                    self.token_log.append((time.perf_counter(), len(sampled)))
                for req, tok in sampled:
                    self._emit(req, tok)
        finally:
            for rid in list(self._live):
                self._close(rid, "abort")

    def _admit(self) -> None:
        while True:
            try:
                req, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if stream.aborted.is_set():
                stream.stats.finish_reason = "abort"
                stream._put(None)
                continue
            try:
                check_sampling(req)
                ids = self._prompt_ids(req.messages)
                self._check_fits(len(ids), req.max_new_tokens)
            except Exception as exc:  # noqa: BLE001 - a bad request fails only itself
                stream.stats.finish_reason = "error"
                stream._put(exc)
                continue
            self._next_rid += 1
            rid = self._next_rid
            stream.stats.prompt_tokens = len(ids)
            self._live[rid] = _Live(req, stream, IncrementalDetokenizer(self.tokenizer), StopStrings(req.stop))
            self.runner.set_params(rid, SamplingParams(req.temperature, req.top_p, req.seed))
            self.scheduler.add(SchedRequest(rid=rid, prompt_ids=ids, max_new_tokens=req.max_new_tokens,
                                            eos_ids=self.eos_ids, prefix_len=self._prefix_len(req.messages, ids)))

    def _check_fits(self, prompt: int, max_new: int) -> None:
        """Raise ValueError if a request could never run: over the KV budget, or longer
        than the model's context (``max_position_embeddings``)."""
        budget = self.scheduler.cfg.max_kv_tokens
        if prompt + max_new > budget:
            raise ValueError(f"prompt of {prompt} tokens + max_new_tokens {max_new} exceeds the KV budget of "
                             f"{budget} tokens")
        context = getattr(self.llm.model.config, "max_position_embeddings", None)
        if context and prompt + max_new > context:
            raise ValueError(f"prompt of {prompt} tokens + max_new_tokens {max_new} exceeds the model's context "
                             f"of {context} tokens")

    def _reap_aborts(self) -> None:
        for rid, live in list(self._live.items()):
            if live.stream.aborted.is_set():
                self.scheduler.abort(rid)
                self.runner.params.pop(rid, None)
                self._close(rid, "abort")

    def _emit(self, req: SchedRequest, tok: int | None) -> None:
        live = self._live.get(req.rid)
        if live is None:
            return
        st = live.stream.stats
        now = time.perf_counter()
        if live.t_first is None:
            live.t_first = now
            st.ttft_ms = (now - live.stream.submitted) * 1000
        st.output_tokens = len(req.output_ids) + (1 if tok is None else 0)
        if tok is not None:
            delta = live.detok.add(tok)
            if delta:
                delta = live.stops.feed(delta)
                if delta:
                    live.stream._put(delta)
                if live.stops.stopped:
                    self.scheduler.finish(req.rid, "stop")
                    self._close(req.rid, "stop", flush=False)
                    return
        if req.state is State.FINISHED:
            self._close(req.rid, req.finish_reason or "stop")

    def _close(self, rid: int, reason: str, *, flush: bool = True) -> None:
        live = self._live.pop(rid, None)
        if live is None:
            return
        st = live.stream.stats
        if flush and reason != "abort":
            tail = live.stops.feed(live.detok.flush())
            tail += live.stops.flush()
            if tail:
                live.stream._put(tail)
        st.finish_reason = reason
        if live.t_first is not None and st.output_tokens > 1:
            st.tpot_ms = (time.perf_counter() - live.t_first) * 1000 / (st.output_tokens - 1)
        live.stream._put(None)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._live):
            live = self._live.pop(rid)
            self.scheduler.abort(rid)
            live.stream.stats.finish_reason = "error"
            live.stream._put(exc)
        self.runner.reset()


@dataclass(slots=True)
class _Live:
    req: GenRequest
    stream: TokenStream
    detok: IncrementalDetokenizer
    stops: StopStrings
    t_first: float | None = None


def check_sampling(req: GenRequest) -> None:
    """Raise ValueError for sampling settings that cannot run: ``max_new_tokens`` < 1,
    a temperature that is not a finite number ≥ 0, ``top_p`` outside (0, 1]."""
    if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {req.max_new_tokens!r}")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise ValueError(f"temperature must be a finite number ≥ 0, got {req.temperature!r}")
    if not (0 < req.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {req.top_p!r}")


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Steps of many different lengths leave the engine thread's malloc arena fragmented:
    200 mixed-length requests grew RSS by 200-450 MB that was free but never returned.
    Called when the engine goes idle, so it costs no step any time.
    """
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC = None
