"""The LLM stage: one engine thread streams replies for every session, batched.

Sessions :meth:`LlmEngine.submit` a :class:`GenRequest` and iterate the returned
:class:`~pipeline.llm.stream.TokenStream` for text deltas; :meth:`TokenStream.abort`
(disconnect, cancel, barge-in) stops its generation at the next token step.

The engine thread repeats :meth:`LlmEngine.step`, the glue of vLLM v1's
``EngineCore.step`` (vllm/v1/engine/core.py): the scheduler plans, the model runner
executes, the engine turns sampled tokens into text for the streams.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeline import metrics
from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.cpu_share import SHARE
from pipeline.errors import Busy
from pipeline.llm import memory
from pipeline.llm.detok import IncrementalDetokenizer, StopStrings
from pipeline.llm.runner.runner import ModelRunner
from pipeline.llm.scheduler import Scheduler
from pipeline.llm.stream import TokenStream
from pipeline.llm.types import FinishReason, GenRequest, SamplingParams, SchedRequest, State, StepPlan
from pipeline.serving.faults import NO_FAULTS, FaultInjector, injected
from pipeline.serving.ladder import free_cached_memory, is_oom, release_free_memory
from pipeline.worker import MAX_OOM_RETRIES, CallGuard, name_native_thread

if TYPE_CHECKING:
    from pipeline.llm.loader import LoadedLLM
    from pipeline.serving.ladder import OomLadder

logger = logging.getLogger(__name__)


class LlmEngine:
    """The process-wide LLM stage: continuous batching in one engine thread.

    Each :meth:`step` the :class:`~pipeline.llm.scheduler.Scheduler` plans who joins,
    decodes or leaves; the :class:`~pipeline.llm.runner.runner.ModelRunner` executes the
    plan; the engine turns sampled tokens into exact text deltas (stop strings applied)
    for each stream. An aborted stream leaves the batch at the next step and its KV rows
    are freed.

    The KV-cache token budget comes from a memory budget at load (:mod:`pipeline.llm.memory`,
    ``LlmConfig.memory_budget_mb``): ``min(sched.max_kv_tokens, (budget − weights −
    activations of one full step) // kv_bytes_per_token)``, never under one full request
    (``max_context_tokens + max_new_tokens``); logged once. A request that would overflow it
    waits for the batch to drain (the scheduler), and admission refuses new turns with
    ``busy`` reason ``memory`` meanwhile (:attr:`kv_budget`).

    Attributes:
        steps: model steps run so far.
        batch_sizes: per step, the requests in it (benchmark, tests; the first 100,000).
        token_log: per step, ``(time.perf_counter() at its end, tokens sampled)``.

    Args:
        llm: a :class:`pipeline.llm.loader.LoadedLLM`.
        cfg: queue size and defaults (see :class:`LlmConfig`).
        sched: batching knobs (see :class:`SchedulerConfig`).
    """

    def __init__(self, llm: LoadedLLM, cfg: LlmConfig, sched: SchedulerConfig | None = None) -> None:
        self.llm = llm
        self.cfg = cfg
        self.tokenizer = llm.tokenizer
        pad = self.tokenizer.pad_token_id
        eos = llm.model.generation_config.eos_token_id
        self.eos_ids = frozenset((eos if isinstance(eos, list) else [eos]) + [self.tokenizer.eos_token_id]) - {None}
        self.runner = ModelRunner(llm.model, llm.device, pad if pad is not None else min(self.eos_ids),
                                  prefix_cache=cfg.prefix_cache)
        sched = sched or SchedulerConfig()
        self.memory = memory.plan(self.runner, llm.model.config, cfg, sched)
        self.scheduler = Scheduler(dataclasses.replace(sched, max_kv_tokens=self.memory.kv_tokens),
                                   on_admit=self.runner.lookup)
        self._inbox: queue.Queue[tuple[GenRequest, TokenStream]] = queue.Queue(maxsize=cfg.queue_size)
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._live: dict[int, _Live] = {}
        self._ended: queue.SimpleQueue[str] = queue.SimpleQueue()  # sessions whose cached KV goes
        self._cache_seen = (0, 0, 0)  # prefix cache stats already counted in the metrics
        self._next_rid = 0
        self.steps = 0
        self.step_ms = 0.0  # moving average of a model step's time (ms), at the batch it ran
        self._trimmed_at = 0
        self.batch_sizes: list[int] = []
        self.token_log: list[tuple[float, int]] = []
        self.faults: FaultInjector = NO_FAULTS  # injected faults (tests, drills)
        self.ladder: OomLadder | None = None  # the out-of-memory ladder (None: an OOM fails the batch)
        self.guard: CallGuard | None = None  # the circuit breaker: told each step's time and outcome
        self.preempted = 0  # requests requeued by an out-of-memory step (recomputed when they run again)
        self._base_batch = sched.max_batch_size
        self._oom_streak = 0
        self._threads_now = cfg.threads  # torch threads of the engine thread (set by load_llm)

    @property
    def depth(self) -> int:
        """Requests waiting to join the batch, not counting those already aborted: the
        engine drops them at its next step, and until then they are nobody's wait (a reply
        cancelled because its user went on speaking must not make that user's next turn
        look queued). Read from any thread: the GIL makes each ``list`` copy atomic."""
        with self._inbox.mutex:
            queued = [stream for _, stream in self._inbox.queue]
        live = self._live
        waiting = [live.get(r.rid) for r in list(self.scheduler.waiting)]
        queued += [lv.stream for lv in waiting if lv is not None]
        return sum(not stream.aborted.is_set() for stream in queued) + waiting.count(None)

    @property
    def urgent_depth(self) -> int:
        """Every LLM request is a reply someone waits for: :attr:`depth`."""
        return self.depth

    @property
    def active(self) -> int:
        """Requests in the batch right now (decoding, or prefilling their prompt)."""
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    @property
    def slots(self) -> int:
        """The batch's size (``max_batch_size``)."""
        return self.scheduler.cfg.max_batch_size

    @property
    def kv_reserved(self) -> int:
        """KV-cache tokens held or reserved: the batch's requests (prompt + max new tokens
        each) and the cached blocks they started from (copies while they run: not evictable).
        Admission's memory check reads this; unreferenced cached blocks are not counted (they
        are evicted to make room)."""
        blocks = self.runner.blocks
        referenced = 0 if blocks is None else max(0, blocks.tokens - blocks.evictable_tokens)  # read racily: >= 0
        return self.scheduler.kv_reserved + referenced

    @property
    def kv_budget(self) -> int:
        """The KV-cache budget in tokens: the configured ``max_kv_tokens``, lowered to what
        the memory budget holds (:class:`~pipeline.llm.memory.MemoryPlan`)."""
        return self.scheduler.cfg.max_kv_tokens

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers (:func:`pipeline.llm.memory.kv_bytes_per_token`)."""
        return self.memory.per_token

    @property
    def memory_budget_bytes(self) -> int:
        """The LLM's memory budget (bytes): weights + KV cache + one step's activations."""
        return self.memory.budget

    @property
    def kv_reserved_bytes(self) -> int:
        """KV bytes the batch's requests may hold: :attr:`kv_reserved` × :attr:`kv_bytes_per_token`."""
        return self.kv_reserved * self.memory.per_token

    def request_bytes(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """KV bytes a request may hold: (prompt + max new tokens) × :attr:`kv_bytes_per_token`.

        Raises:
            ValueError: a negative token count.
        """
        if prompt_tokens < 0 or max_new_tokens < 0:
            raise ValueError("prompt_tokens and max_new_tokens must be >= 0")
        return (prompt_tokens + max_new_tokens) * self.memory.per_token

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="voxpipe-llm", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread; unfinished streams, queued or running, end with ``abort``."""
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
        stream = TokenStream(self._wake)
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

    def end_session(self, session: str) -> None:
        """``session`` ended: its cached KV blocks (those no other session made) are
        released at the next step (thread-safe)."""
        self._ended.put(session)
        self._wake.set()

    @property
    def prefix_cache_stats(self) -> tuple[int, int, int, int]:
        """(prompt tokens looked up, found in the cache, blocks evicted, tokens cached now)."""
        blocks = self.runner.blocks
        if blocks is None:
            return 0, 0, 0, 0
        st = blocks.stats
        return st.queried_tokens, st.hit_tokens, st.evictions, blocks.tokens

    # ---- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        """The engine thread: step; sleep when a step says so, until woken (submit, abort)."""
        name_native_thread()
        try:
            while not self._stop:
                sleep_s = self.step()
                if sleep_s:
                    self._wake.wait(None if sleep_s == math.inf else sleep_s)
                    self._wake.clear()
        finally:
            self._abort_all()

    def step(self) -> float:
        """One engine iteration, shaped like vLLM v1's ``EngineCore.step``
        (vllm/v1/engine/core.py): take in new requests and aborts, schedule, execute the
        plan, process the outputs (text to the streams, finished requests closed).

        Runs on the engine thread (:meth:`start`); a failed model step fails the requests
        in the batch (their streams raise it) and the engine carries on.

        Returns:
            how long (s) the engine may sleep before the next step unless woken: 0 after
            a model step, the scheduler's hold time while a lone request waits for
            company, ``math.inf`` when there is no work at all.
        """
        self._admit_new()
        self._reap_aborts()
        self._follow_ladder()
        self._cache_housekeeping()
        plan = self.scheduler.schedule()
        if plan.empty:
            return self._idle(plan)
        self._pick_threads()
        outputs = self._execute(plan)
        if outputs is not None:
            sampled = self.scheduler.update(plan, outputs)
            self._record_step(plan, sampled)
            self._process_outputs(sampled)
        return 0.0

    # ---- step parts ------------------------------------------------------------------

    def _admit_new(self) -> None:
        """Hand submitted requests to the scheduler; one that can never run ends at once
        with its error (finish reason ``error``), an aborted one with ``abort``."""
        while True:
            try:
                req, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if stream.aborted.is_set():
                _end(stream, FinishReason.ABORT)
                continue
            try:
                sched = self._sched_request(req)
            except Exception as exc:  # noqa: BLE001 - a bad request fails only itself
                _end(stream, FinishReason.ERROR, exc)
                continue
            stream.stats.prompt_tokens = len(sched.prompt_ids)
            self._live[sched.rid] = _Live(stream, IncrementalDetokenizer(self.tokenizer), StopStrings(req.stop))
            self.scheduler.add(sched)

    def _sched_request(self, req: GenRequest) -> SchedRequest:
        """The scheduler's view of ``req``: prompt ids, limits and sampling settings.

        Raises:
            ValueError: bad sampling settings (:func:`check_sampling`), or a prompt that
                can never fit (:meth:`_check_fits`).
        """
        check_sampling(req)
        ids = self._prompt_ids(req.messages)
        self._check_fits(len(ids), req.max_new_tokens)
        self._next_rid += 1
        return SchedRequest(rid=self._next_rid, prompt_ids=ids, max_new_tokens=req.max_new_tokens,
                            eos_ids=self.eos_ids, owner=req.session, sampling=SamplingParams.of(req),
                            priority=req.priority)

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
        """End aborted streams; the scheduler drops their requests, and the next plan
        frees their batch rows (``StepPlan.evict``)."""
        for rid, live in list(self._live.items()):
            if live.stream.aborted.is_set():
                self.scheduler.abort(rid)
                self._close(rid, FinishReason.ABORT)

    def _idle(self, plan: StepPlan) -> float:
        """Nothing to run now: how long to sleep (see :meth:`step`)."""
        if self.scheduler.has_work():
            return plan.wait_s or 0.001
        self._trim_idle_memory()
        return math.inf

    def _trim_idle_memory(self) -> None:
        """Return freed heap pages to the OS (:func:`release_free_memory`) once per idle
        period, not on every wake-up."""
        if self.steps != self._trimmed_at:
            self._trimmed_at = self.steps
            release_free_memory()

    def _pick_threads(self) -> None:
        """Borrow the idle cores for this step: ``burst_threads`` while no ASR/TTS call is
        in progress, else ``threads`` (:mod:`pipeline.cpu_share`; ``burst_threads`` None: no burst)."""
        cfg = self.cfg
        burst = cfg.burst_threads or 0
        want = burst if burst > cfg.threads and not SHARE.others_working else cfg.threads
        if want != self._threads_now:
            self.runner.set_threads(want)
            self._threads_now = want

    def _execute(self, plan: StepPlan) -> dict[int, int] | None:
        """Run ``plan`` on the model: ``rid -> sampled token``, or None when the step
        failed: out of memory, the batch is requeued (:meth:`_out_of_memory`); otherwise
        every request in flight ends with the error."""
        t0 = time.perf_counter()
        try:
            if plan.decode or plan.prefill:
                self.faults.hit("llm")
            out = self.runner.execute(plan)
        except Exception as exc:  # the streams get the error; the engine carries on
            if is_oom(exc) and self.ladder is not None and self._oom_streak < MAX_OOM_RETRIES:
                self._out_of_memory(exc)  # the ladder's business, not the breaker's
                return None
            if self.guard is not None:
                self.guard.record(time.perf_counter() - t0, True)
            logger.error("llm step failed: %s", exc, exc_info=not (is_oom(exc) or injected(exc)))
            self._oom_streak = 0
            self._fail_all(exc)
            return None
        self._oom_streak = 0
        if plan.decode or plan.prefill:  # an evict-only step says nothing of a step's cost
            ms = (time.perf_counter() - t0) * 1000
            self.step_ms = ms if self.step_ms == 0.0 else self.step_ms + 0.1 * (ms - self.step_ms)
            if self.guard is not None:
                self.guard.record(ms / 1000, False)
        return out

    def _out_of_memory(self, exc: BaseException) -> None:
        """A step ran out of memory: climb the ladder, drop the batch's KV (a failed step may
        have left it half-written) and the prefix cache, free cached memory, and requeue every
        request in the batch, oldest first, to be recomputed from its prompt and the tokens it
        already sent (vLLM's recompute preemption): no reply is lost or repeated. From step 2
        on, the batch is halved (:meth:`_follow_ladder`): the newest wait for a slot."""
        assert self.ladder is not None
        self._oom_streak += 1
        step = self.ladder.oom(time.monotonic())
        requeued = self.scheduler.preempt_all()
        self.preempted += requeued
        self.runner.reset()
        self.free_memory()
        logger.warning("llm out of memory (%s): %d requests requeued, ladder step %d", exc, requeued, step)

    def free_memory(self) -> None:
        """The ladder's step 1 for the LLM: evict every unreferenced cached block, then
        :func:`free_cached_memory`."""
        if self.runner.blocks is not None:
            self.runner.blocks.clear()
        free_cached_memory()

    def _cache_housekeeping(self) -> None:
        """Release ended sessions' cached blocks; bound the cache by what the KV budget
        leaves after the batch's reservations; count its hits for the metrics."""
        blocks = self.runner.blocks
        if blocks is None:
            return
        while True:
            try:
                blocks.release_owner(self._ended.get_nowait())
            except queue.Empty:
                break
        self.runner.cache_limit = max(0, self.kv_budget - self.scheduler.kv_reserved)
        st = blocks.stats
        queried, hit, evicted = self._cache_seen
        if (st.queried_tokens, st.hit_tokens, st.evictions) != self._cache_seen:
            metrics.PREFIX_QUERIED.inc(st.queried_tokens - queried)
            metrics.PREFIX_HIT.inc(st.hit_tokens - hit)
            metrics.PREFIX_EVICTED.inc(st.evictions - evicted)
            self._cache_seen = (st.queried_tokens, st.hit_tokens, st.evictions)

    def _follow_ladder(self) -> None:
        """Apply the ladder's batch size (halved from step 2 on) to the scheduler."""
        if self.ladder is None:
            return
        size = self.ladder.batch_size(self._base_batch)
        if size != self.scheduler.cfg.max_batch_size:
            self.scheduler.cfg = dataclasses.replace(self.scheduler.cfg, max_batch_size=size)
            logger.info("llm batch size now %d", size)

    def _record_step(self, plan: StepPlan, sampled: list[tuple[SchedRequest, int | None]]) -> None:
        """Count the step; record its batch size (Prometheus ``LLM_BATCH``,
        :attr:`batch_sizes`) and its sampled tokens (:attr:`token_log`)."""
        self.steps += 1
        size = len(plan.decode) + len(plan.prefill)  # 0: the step only freed rows
        if not size:
            return
        metrics.LLM_BATCH.observe(size)
        if len(self.batch_sizes) < 100_000:
            self.batch_sizes.append(size)
            self.token_log.append((time.perf_counter(), len(sampled)))

    def _process_outputs(self, sampled: list[tuple[SchedRequest, int | None]]) -> None:
        """Turn each sampled token (None: end of sequence) into text on its stream; close
        the requests that finished (length, EOS, or a stop string in the text)."""
        now = time.perf_counter()
        for req, tok in sampled:
            live = self._live.get(req.rid)
            if live is None:
                continue
            _count_token(live, req, tok, now)
            if tok is not None and _emit_text(live, tok):
                self.scheduler.finish(req.rid, FinishReason.STOP)
                self._close(req.rid, FinishReason.STOP, flush=False)
            elif req.state is State.FINISHED:
                self._close(req.rid, req.finish_reason or FinishReason.STOP)

    # ---- ending streams ----------------------------------------------------------------

    def _close(self, rid: int, reason: FinishReason, *, flush: bool = True) -> None:
        """End a live request's stream: the held-back text first (unless aborted or
        ``flush`` is False), then ``tpot_ms`` and the finish reason."""
        live = self._live.pop(rid, None)
        if live is None:
            return
        if flush and reason is not FinishReason.ABORT:
            tail = live.stops.feed(live.detok.flush()) + live.stops.flush()
            if tail:
                live.stream.put(tail)
        st = live.stream.stats
        if live.t_first is not None and st.output_tokens > 1:
            st.tpot_ms = (time.perf_counter() - live.t_first) * 1000 / (st.output_tokens - 1)
        _end(live.stream, reason)

    def _fail_all(self, exc: BaseException) -> None:
        """A model step failed: end every live request with ``exc`` and drop the batch."""
        for rid in list(self._live):
            live = self._live.pop(rid)
            self.scheduler.abort(rid)
            _end(live.stream, FinishReason.ERROR, exc)
        self.runner.reset()

    def _abort_all(self) -> None:
        """The engine stops: every unfinished stream, queued or live, ends with ``abort``."""
        while True:
            try:
                _, stream = self._inbox.get_nowait()
            except queue.Empty:
                break
            _end(stream, FinishReason.ABORT)
        for rid in list(self._live):
            self.scheduler.abort(rid)
            self._close(rid, FinishReason.ABORT)


@dataclass(slots=True)
class _Live:
    """The engine's state of a request in the scheduler: its stream and text pipeline."""

    stream: TokenStream
    detok: IncrementalDetokenizer
    stops: StopStrings
    t_first: float | None = None  # perf_counter() at its first token (s)


def _count_token(live: _Live, req: SchedRequest, tok: int | None, now: float) -> None:
    """Update ``ttft_ms`` (at the first token) and ``output_tokens`` (EOS counts)."""
    st = live.stream.stats
    if live.t_first is None:
        live.t_first = now
        st.ttft_ms = (now - live.stream.submitted) * 1000
    st.output_tokens = len(req.output_ids) + (1 if tok is None else 0)


def _emit_text(live: _Live, tok: int) -> bool:
    """Detokenize ``tok`` and put the text that is safe to send on the stream; True
    when a stop string has ended the reply."""
    delta = live.detok.add(tok)
    if not delta:
        return False
    delta = live.stops.feed(delta)
    if delta:
        live.stream.put(delta)
    return live.stops.stopped


def _end(stream: TokenStream, reason: FinishReason, error: BaseException | None = None) -> None:
    """Set the finish reason, then end the stream (with ``error`` for the consumer)."""
    stream.stats.finish_reason = reason
    stream.end(error)


def check_sampling(req: GenRequest) -> None:
    """Raise ValueError for sampling settings that cannot run: ``max_new_tokens`` < 1,
    a temperature that is not a finite number ≥ 0, ``top_p`` outside (0, 1]."""
    if not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer ≥ 1, got {req.max_new_tokens!r}")
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise ValueError(f"temperature must be a finite number ≥ 0, got {req.temperature!r}")
    if not (0 < req.top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {req.top_p!r}")
