"""The LLM stage: one engine thread streams replies for every session, batched.

Sessions :meth:`LlmEngine.submit` a :class:`GenRequest` and iterate the returned
:class:`~pipeline.llm.stream.TokenStream` for text deltas; :meth:`TokenStream.abort`
(disconnect, cancel, barge-in) stops its generation at the next token step. The engine
thread repeats :meth:`LlmEngine.step`, the glue of vLLM v1's ``EngineCore.step``
(vllm/v1/engine/core.py): the input processor (:mod:`pipeline.llm.input`) turns requests into
the scheduler's, the scheduler plans, the model runner executes, the output processor
(:mod:`pipeline.llm.output`) turns sampled tokens into text for the streams."""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pipeline.config import LlmConfig, SchedulerConfig
from pipeline.errors import Busy
from pipeline.llm import memory
from pipeline.llm.host import HostShare
from pipeline.llm.input import InputProcessor, eos_token_ids, reply_prefix
from pipeline.llm.output import OutputProcessor, end_stream
from pipeline.llm.prefix import PrefixCacheKeeper
from pipeline.llm.runner.runner import ModelRunner
from pipeline.llm.scheduler import Scheduler
from pipeline.llm.stats import StepStats
from pipeline.llm.stream import TokenStream
from pipeline.llm.types import FinishReason, GenRequest, StepPlan
from pipeline.serving.faults import NO_FAULTS, FaultInjector, injected
from pipeline.serving.ladder import free_cached_memory, is_oom
from pipeline.serving.types import StageLoad
from pipeline.tools.types import ToolSpec
from pipeline.worker import MAX_OOM_RETRIES, CallGuard, name_native_thread

if TYPE_CHECKING:
    from pipeline.llm.loader import LoadedLLM
    from pipeline.serving.ladder import OomLadder

logger = logging.getLogger(__name__)


class LlmEngine:
    """The process-wide LLM stage: continuous batching in one engine thread.

    Each :meth:`step` the :class:`~pipeline.llm.scheduler.Scheduler` plans who joins,
    decodes or leaves; the :class:`~pipeline.llm.runner.runner.ModelRunner` executes the
    plan; the :class:`~pipeline.llm.output.OutputProcessor` turns sampled tokens into exact
    text deltas (stop strings applied) for each stream. An aborted stream leaves the batch
    at the next step and its KV rows are freed. A request that would overflow the KV budget
    waits for the batch to drain (the scheduler; admission refuses new turns meanwhile).

    Attributes:
        memory: the KV-memory arithmetic at load (budget, bytes per token, the KV token budget).
        input: the input processor (chat template, checks). output: the output processor.
        prefix: the prefix cache's keeper (sessions' ends, its bound, ``prefix.stats``).
        stats: steps run, a step's time, batch sizes, tokens sampled (:class:`~pipeline.llm.stats.StepStats`).

    Args:
        llm: a :class:`pipeline.llm.loader.LoadedLLM`.
        cfg: queue size and defaults (see :class:`LlmConfig`).
        sched: batching knobs (see :class:`SchedulerConfig`).
    """

    def __init__(self, llm: LoadedLLM, cfg: LlmConfig, sched: SchedulerConfig | None = None) -> None:
        self.llm, self.cfg = llm, cfg
        pad, eos_ids = llm.tokenizer.pad_token_id, eos_token_ids(llm.tokenizer, llm.model.generation_config)
        self.runner = ModelRunner(llm.model, llm.device, pad if pad is not None else min(eos_ids),
                                  prefix_cache=cfg.prefix_cache)
        sched = sched or SchedulerConfig()
        self.memory = memory.plan(self.runner, llm.model.config, cfg, sched)
        self.scheduler = Scheduler(dataclasses.replace(sched, max_kv_tokens=self.memory.kv_tokens),
                                   on_admit=self.runner.lookup)
        self.input = InputProcessor(llm.tokenizer, eos_ids, kv_budget=self.memory.kv_tokens,
                                    context=getattr(llm.model.config, "max_position_embeddings", None))
        self.output = OutputProcessor(llm.tokenizer)
        self.prefix = PrefixCacheKeeper(self.runner, self.memory)
        self._inbox: queue.Queue[tuple[GenRequest, TokenStream]] = queue.Queue(maxsize=cfg.queue_size)
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.stats = StepStats()
        self.host = HostShare(self.runner, cfg)  # threads per step, heap trimming when idle
        self.faults: FaultInjector = NO_FAULTS  # injected faults (tests, drills)
        self.ladder: OomLadder | None = None  # the out-of-memory ladder (None: an OOM fails the batch)
        self.guard: CallGuard | None = None  # the circuit breaker: told each step's time and outcome
        self.preempted = 0  # requests requeued by an out-of-memory step (recomputed when they run again)
        self._base_batch = sched.max_batch_size
        self._oom_streak = 0

    def load(self) -> StageLoad:
        """The stage's load, from any thread (each read atomic under the GIL). ``depth`` =
        ``urgent_depth``: every request is a reply someone waits for. ``kv_reserved``: the
        batch's requests and the cached blocks they started from (not evictable meanwhile)."""
        depth, sched, cached = self._depth(), self.scheduler, self.prefix.referenced_tokens()
        return StageLoad(depth=depth, urgent_depth=depth, active=len(sched.running) + len(sched.prefilling),
                         slots=sched.cfg.max_batch_size, kv_reserved=sched.kv_reserved + cached,
                         kv_budget=sched.cfg.max_kv_tokens, step_ms=self.stats.step_ms)

    def _depth(self) -> int:
        """Requests waiting to join the batch, but aborted ones: dropped at the next step, they are
        nobody's wait (a reply cancelled as its user went on speaking must not make the next turn queue)."""
        with self._inbox.mutex:
            queued = [stream for _, stream in self._inbox.queue]
        waiting = [self.output.stream_of(r.rid) for r in list(self.scheduler.waiting)]
        live = [stream for stream in queued + waiting if stream is not None]
        return sum(not stream.aborted.is_set() for stream in live) + waiting.count(None)

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
            if self._depth() >= self._inbox.maxsize:  # the bound covers requests waiting for a slot too
                raise queue.Full
            self._inbox.put_nowait((req, stream))
        except queue.Full:
            raise Busy(f"llm is busy: {self._inbox.maxsize} requests already queued") from None
        self._wake.set()
        return stream

    def count_tokens(self, messages: list[dict], tools: tuple[ToolSpec, ...] = ()) -> int:
        """Prompt tokens of ``messages`` (with ``tools`` offered) under the model's chat template."""
        return self.input.count_tokens(messages, tools)

    def end_session(self, session: str) -> None:
        """``session`` ended: its cached KV blocks go at the next step (thread-safe)."""
        self.prefix.end_session(session)
        self._wake.set()

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
        self.prefix.housekeeping(self.scheduler.kv_reserved)
        plan = self.scheduler.schedule()
        if plan.empty:
            return self._idle(plan)
        self.host.pick_threads()
        outputs = self._execute(plan)
        if outputs is not None:
            sampled = self.scheduler.update(plan, outputs)
            self.stats.record(len(plan.decode) + len(plan.prefill), len(sampled))
            for rid in self.output.process_outputs(sampled):  # a stop string ended it
                self.scheduler.finish(rid, FinishReason.STOP)
                self.output.close(rid, FinishReason.STOP, flush=False)
        return 0.0

    def _admit_new(self) -> None:
        """Hand submitted requests to the scheduler; one that can never run ends at once
        with its error (finish reason ``error``), an aborted one with ``abort``."""
        for req, stream in self._drain():
            if stream.aborted.is_set():
                end_stream(stream, FinishReason.ABORT)
                continue
            try:
                sched = self.input.process(req)
            except Exception as exc:  # noqa: BLE001 - a bad request fails only itself
                end_stream(stream, FinishReason.ERROR, exc)
                continue
            self.output.add(sched, stream, req.stop, reply_prefix(req))
            self.scheduler.add(sched)

    def _drain(self) -> Iterator[tuple[GenRequest, TokenStream]]:
        """Take submitted requests one at a time until the inbox is empty."""
        while True:
            try:
                yield self._inbox.get_nowait()
            except queue.Empty:
                return

    def _reap_aborts(self) -> None:
        """End aborted streams; the scheduler drops their requests, and the next plan
        frees their batch rows (``StepPlan.evict``)."""
        for rid in self.output.aborted():
            self.scheduler.abort(rid)
            self.output.close(rid, FinishReason.ABORT)

    def _idle(self, plan: StepPlan) -> float:
        """Nothing to run now: how long to sleep (see :meth:`step`)."""
        if self.scheduler.has_work():
            return plan.wait_s or 0.001
        self.host.idle(self.stats.steps)
        return math.inf

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
            self.stats.timed(ms := (time.perf_counter() - t0) * 1000)
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
        """The ladder's step 1: evict every unreferenced cached block; :func:`free_cached_memory`."""
        self.prefix.clear()
        free_cached_memory()

    def _follow_ladder(self) -> None:
        """Apply the ladder's batch size (halved from step 2 on) to the scheduler."""
        if self.ladder is None:
            return
        size = self.ladder.batch_size(self._base_batch)
        if size != self.scheduler.cfg.max_batch_size:
            self.scheduler.cfg = dataclasses.replace(self.scheduler.cfg, max_batch_size=size)
            logger.info("llm batch size now %d", size)

    def _fail_all(self, exc: BaseException) -> None:
        """A model step failed: end every live request with ``exc`` and drop the batch."""
        for rid in list(self.output.live):
            self.scheduler.abort(rid)
            self.output.fail(rid, exc)
        self.runner.reset()

    def _abort_all(self) -> None:
        """The engine stops: every unfinished stream, queued or live, ends with ``abort``."""
        for _, stream in self._drain():
            end_stream(stream, FinishReason.ABORT)
        for rid in list(self.output.live):
            self.scheduler.abort(rid)
            self.output.close(rid, FinishReason.ABORT)
